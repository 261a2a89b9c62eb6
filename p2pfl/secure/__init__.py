"""The secure wire: who a node is (identity), how a message is framed, signed and
encrypted (wire), and how tensors travel without pickle (tensors). Knows nothing
about learning."""
