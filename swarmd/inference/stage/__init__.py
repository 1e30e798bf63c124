"""A pipeline stage's actor: its requests' book, its batch scheduler and the batch on the compute thread."""
