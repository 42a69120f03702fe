"""The demo route of `make run`: logs a greeting per occurrence."""

import logging

from perfectschedd import Application

log = logging.getLogger("demo")


class Hello(Application):
    def run(self) -> None:
        who = self.task.data.get("who", "world")
        log.info("hello, %s (key %s, occurrence %d)", who, self.task.key,
                 self.task.scheduled_time)
        self.task.finish()
