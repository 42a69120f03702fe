"""Where the config file, the control socket and the schedules files are unless told
otherwise.  Apart from config.py so that perfectschedctl, which needs the socket's path
at every start, loads none of the config's code (YAML, the checks of routes)."""

DEFAULT_CONFIG_PATH = "/etc/perfectsched/perfectsched.yml"
DEFAULT_SOCKET = "/run/perfectsched/perfectschedd.sock"
DEFAULT_SCHEDULES_DIR = "/etc/perfectsched/schedules.d"
