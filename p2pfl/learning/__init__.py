"""Local learning at one site: data, models, the training loops, self- and
semi-supervised training, metrics. Knows nothing about the network."""
