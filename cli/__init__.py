"""The `pdcluster` command line, the highest layer: main.py builds the parser from each subcommand's
module (in cluster/ and here) and dispatches."""
