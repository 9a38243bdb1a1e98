"""What every command does on the machine it runs on: atomic files, where it may write,
locks on the directories it writes, Ctrl-C and SIGTERM, and pausing the collector."""
