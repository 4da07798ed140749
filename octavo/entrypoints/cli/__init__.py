"""`octavo` subcommands: generate, chat, pull, bench."""
