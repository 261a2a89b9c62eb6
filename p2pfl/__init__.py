"""p2pfl foundation: config, identity, wire, tensors codec, data, models, training, metrics."""
