"""perfectschedctl: the command-line client of perfectschedd."""
