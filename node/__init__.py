"""The p2pfl-node daemon and CLI."""
