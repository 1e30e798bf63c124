"""The `swarmd` command line. One module per subcommand, each with `register(subparsers)`.

Subcommand modules keep heavy imports (tinygrad, libp2p) inside their functions so that
`swarmd --help` and `swarmd status` start fast.
"""
