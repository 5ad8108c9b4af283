"""The data layer: datasets, partitions, the federated dataset, a node's own data."""
