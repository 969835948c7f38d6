"""The flags of every `tokenrelay` command, from the command line and from the environment."""
