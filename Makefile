# PerfectSched developer entry points.  `make run` and `make test` work from a fresh clone;
# `make check` runs everything CI runs (.ci/run).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEVCFG := etc/dev.yml
# Its section: a root daemon needs every route to say who it runs as (etc/dev.yml).
DEVENV := $(if $(filter 0,$(shell id -u)),root,user)
# pytest-xdist processes: the tests mostly wait on daemons' timers and database servers,
# so twice the cores keeps a 2-core machine busy without starving those timers.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) * 2 )))
# Idle test processes take queued tests from busy ones: by default each is handed its
# share up front, and the long daemon tests left at the end kept one or two busy while the
# others waited (make test: 453 s, 333 s with worksteal; pytest-xdist >= 3.2).
XDIST := --dist worksteal
# Print the slowest tests of each run, so that one that grows is seen.
DURATIONS := --durations=15 --durations-min=1

.PHONY: run test test-quick check test-deps test-slow test-faults test-debian test-system lint bench deb clean

$(BIN)/perfectschedd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

run: $(BIN)/perfectschedd
	mkdir -p var
	$(BIN)/perfectschedctl -c $(DEVCFG) -e $(DEVENV) init
	@$(BIN)/perfectschedctl -c $(DEVCFG) -e $(DEVENV) add demo-hello demo '* * * * *' '{"who": "world"}' \
	  2>/dev/null || true
	@echo "In another terminal, to use perfectschedctl:"
	@echo "  export PERFECTSCHED_SOCKET=$(CURDIR)/var/perfectschedd.sock PATH=$(CURDIR)/$(BIN):\$$PATH"
	$(BIN)/perfectschedd -c $(DEVCFG) -e $(DEVENV) -I etc/demo

lint: $(BIN)/perfectschedd
	$(BIN)/ruff check .

# apt installs, timed apart from the tests (nothing to do once installed: well under 1 s).
test-deps:
	@start=$$(date +%s); ./tests/install-test-deps.sh; \
	echo "test-deps: $$(( $$(date +%s) - start )) s (apt installs, not counted in the test time)"

# The whole suite once (SQLite, and the PostgreSQL and MariaDB servers it starts), newest
# libraries, in parallel: what a change must pass.  The fault suite, Debian's libraries,
# the package and the system tests are `make check`'s.
test: $(BIN)/perfectschedd test-deps
	@start=$$(date +%s); rc=0; \
	$(BIN)/ruff check . && \
	$(BIN)/pytest -q -n $(TEST_WORKERS) $(XDIST) $(DURATIONS) \
	  -m "not system and not faults and not serial and not slow" || rc=1; \
	$(BIN)/pytest -q $(DURATIONS) -m "serial and not system and not faults" || rc=1; \
	echo "make test: $$(( $$(date +%s) - start )) s with $(TEST_WORKERS) test processes" \
	  "(rc $$rc)"; exit $$rc

# The loop to run while working: the package's own tests that start no daemon and no
# database server (marker `quick`, set by tests/conftest.py), ruff first.  Under a minute;
# `make test` before a commit.  A room alone: make test-quick QUICK=tests/store
QUICK ?= tests
test-quick: $(BIN)/perfectschedd
	@start=$$(date +%s); rc=0; \
	$(BIN)/ruff check . && $(BIN)/pytest -q -n $(TEST_WORKERS) $(XDIST) -p no:cacheprovider -m quick $(QUICK) || rc=1; \
	echo "make test-quick: $$(( $$(date +%s) - start )) s (rc $$rc)"; exit $$rc

# The tests that wait a minute or more (jobs of 120 s through reloads, 30 s stops), and
# the PostgreSQL and MariaDB runs of the longest tests (slow_on_servers, whose SQLite run
# is make test's): side by side, twice as many as make test runs at once.
test-slow: $(BIN)/perfectschedd test-deps
	$(BIN)/pytest -q -n $$(( $(TEST_WORKERS) * 2 )) $(XDIST) $(DURATIONS) -m "slow and not system and not faults"

# Fault injection (SIGSTOP/kill -9 of database servers, clocks, full disks, clusters; the
# master's loop against a frozen server, tests/master/test_master_never_waits.py): one
# test at a time, as each one disturbs shared servers on purpose.
test-faults: $(BIN)/perfectschedd test-deps
	$(BIN)/pytest -q $(DURATIONS) -m faults tests

# Everything: lint and the suite, the fault suite, Debian 12's libraries, the package
# (its build runs its own tests, then lintian) and the system tests on Debian 12 and 13.
# Each step's time is printed at the end; the first failure fails the whole.
CHECK_STEPS := test test-slow test-faults test-debian test-system
check:
	@rm -f build/check.times; mkdir -p build; rc=0; \
	for step in $(CHECK_STEPS); do \
	  start=$$(date +%s); echo "=== make $$step"; \
	  $(MAKE) --no-print-directory $$step || { rc=1; echo "=== make $$step FAILED"; }; \
	  echo "$$step: $$(( $$(date +%s) - start )) s" >> build/check.times; \
	  [ $$rc = 0 ] || break; \
	done; \
	echo "=== make check: $$([ $$rc = 0 ] && echo passed || echo FAILED)"; cat build/check.times; \
	exit $$rc

# Second run against Debian 12's own libraries (SQLAlchemy 1.4.46 + psycopg2, croniter
# 1.3.5, PyYAML 6.0, ...): a venv of /usr/bin/python3 that sees the python3-* packages
# installed by tests/install-test-deps.sh; nothing comes from PyPI.
DEBVENV := .venv-debian
DEBIAN_LIBS := SQLAlchemy croniter PyYAML prometheus_client sdnotify dbus_next \
               psycopg2 PyMySQL pytest pytest-xdist
test-debian: test-deps
	test -x $(DEBVENV)/bin/python || /usr/bin/python3 -m venv --system-site-packages $(DEBVENV)
	env -u PYTHONPATH $(DEBVENV)/bin/python -m pip install -q --no-deps --no-index \
	  --no-build-isolation --disable-pip-version-check -e .
	@env -u PYTHONPATH $(DEBVENV)/bin/python -c 'import sys, sqlalchemy, importlib.metadata as m; \
	  v = [f"Python {sys.version.split()[0]}"] + [f"{n} {m.version(n)}" for n in sys.argv[1:]]; \
	  print("test-debian runs with:", ", ".join(v)); \
	  assert sqlalchemy.__file__.startswith("/usr/lib/python3/dist-packages/"), sqlalchemy.__file__' \
	  $(DEBIAN_LIBS)
	env -u PYTHONPATH PERFECTSCHED_TEST_BACKENDS=sqlite,postgresql \
	  $(DEBVENV)/bin/python -m pytest -q -n $(TEST_WORKERS) $(DURATIONS) \
	  -m "not system and not faults and not serial and not slow"
	env -u PYTHONPATH PERFECTSCHED_TEST_BACKENDS=sqlite,postgresql \
	  $(DEBVENV)/bin/python -m pytest -q $(DURATIONS) -m "serial and not system and not faults"

clean:
	rm -rf $(VENV) .venv-debian var dist build *.egg-info

# --- Debian package (packaging/debian/, built from a copy of the tree; no venv) -------
# Builds with Debian's own python3 (PATH below), installs missing build dependencies
# with apt (root), runs the quick tests inside pybuild, checks with lintian --pedantic.
DEB_BUILD := build/deb
DEB_SRC   := $(DEB_BUILD)/perfectsched
DEB_PATH  := /usr/sbin:/usr/bin:/sbin:/bin
.PHONY: deb
deb:
	rm -rf $(DEB_BUILD) && mkdir -p $(DEB_SRC) dist
	{ git ls-files -z --cached --others --exclude-standard 2>/dev/null || \
	  find . -path ./.git -prune -o -path ./.venv -prune -o -path './.venv-*' -prune \
	       -o -path ./build -prune -o -path ./dist -prune -o -type f -print0; } | \
	  tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C $(DEB_SRC)
	rm -rf $(DEB_SRC)/debian && cp -a packaging/debian $(DEB_SRC)/debian
	cd $(DEB_SRC) && if ! env PATH=$(DEB_PATH) dpkg-checkbuilddeps 2>/dev/null; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get build-dep -y -qq ./ >/dev/null || { apt-get update -qq && apt-get build-dep -y -qq ./; }; fi
	command -v lintian >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends lintian >/dev/null
	cd $(DEB_SRC) && env -u PYTHONPATH -u PYTHONHOME -u VIRTUAL_ENV -u PYTHONDONTWRITEBYTECODE \
	  PATH=$(DEB_PATH) dpkg-buildpackage -us -uc -b > ../build.log 2>&1 || \
	  { tail -60 ../build.log; echo "dpkg-buildpackage failed; full log: $(DEB_BUILD)/build.log"; exit 1; }
	grep -E '^=+ .*(passed|failed|error).* =+$$' $(DEB_BUILD)/build.log || true
	rm -f dist/perfectsched_*.deb && cp $(DEB_BUILD)/perfectsched_*.deb dist/
	env PATH=$(DEB_PATH) lintian --pedantic --fail-on error,warning \
	  --suppress-tags initial-upload-closes-no-bugs $(DEB_BUILD)/perfectsched_*.changes
	@ls -l dist/perfectsched_*.deb

# --- the released 0.1.0 package, built from its commit (the upgrade test starts there) --
# Built, not stored: what a user of 0.1.0 installed.  A commit never changes, so the .deb
# is kept once built (`make clean` removes it).  Its tests ran at its release: nocheck.
OLD_VERSION   := 0.1.0
OLD_COMMIT    := 0ffb1ea
OLD_DEB_BUILD := build/deb-$(OLD_VERSION)
OLD_DEB       := dist/old/perfectsched_$(OLD_VERSION)_all.deb
.PHONY: deb-$(OLD_VERSION)
deb-$(OLD_VERSION): $(OLD_DEB)
$(OLD_DEB):
	rm -rf $(OLD_DEB_BUILD) && mkdir -p $(OLD_DEB_BUILD)/perfectsched $(@D)
	git archive --format=tar -o $(OLD_DEB_BUILD)/source.tar $(OLD_COMMIT)
	tar -xf $(OLD_DEB_BUILD)/source.tar -C $(OLD_DEB_BUILD)/perfectsched
	cd $(OLD_DEB_BUILD)/perfectsched && rm -rf debian && cp -a packaging/debian debian
	cd $(OLD_DEB_BUILD)/perfectsched && if ! env PATH=$(DEB_PATH) dpkg-checkbuilddeps 2>/dev/null; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get build-dep -y -qq ./ >/dev/null || { apt-get update -qq && apt-get build-dep -y -qq ./; }; fi
	cd $(OLD_DEB_BUILD)/perfectsched && env -u PYTHONPATH -u PYTHONHOME -u VIRTUAL_ENV \
	  -u PYTHONDONTWRITEBYTECODE PATH=$(DEB_PATH) DEB_BUILD_OPTIONS=nocheck \
	  dpkg-buildpackage -us -uc -b > ../build.log 2>&1 || \
	  { tail -60 ../build.log; echo "dpkg-buildpackage failed; full log: $(OLD_DEB_BUILD)/build.log"; exit 1; }
	cp $(OLD_DEB_BUILD)/perfectsched_$(OLD_VERSION)_all.deb $@.tmp && mv $@.tmp $@
	@ls -l $@

# --- system test: real systemd as PID 1 of a namespace, the .deb installed by apt -----
# test_upgrade.py installs $(OLD_DEB) first, then upgrades to the .deb of `make deb`.
# Every module runs once per root in SYSTEST_ROOTS (PERFECTSCHED_NS_ROOTFS): / is the
# host's own (Debian 12, systemd 252), trixie is Debian 13 (systemd 257), a tree that
# tests/system/rootfs.sh builds once with mmdebstrap (test-deps installs it) and keeps in
# /var/cache/perfectsched-ns.  The same two .debs on each.  Each run's log is in
# build/systest/; their summary lines are repeated at the end.
SYSTEST_ROOTS ?= / trixie
SYSTEST_LOGS  := build/systest
test-system: test-deps deb deb-$(OLD_VERSION)
	@rm -rf $(SYSTEST_LOGS) && mkdir -p $(SYSTEST_LOGS); rc=0; \
	for root in $(SYSTEST_ROOTS); do \
	  case $$root in /*) tree=$$root;; *) tree=$$(tests/system/rootfs.sh $$root) || exit 1;; esac; \
	  name=$$(. $$tree/etc/os-release && echo "$$PRETTY_NAME"); \
	  case $$root in /) label=host;; *) label=$$(basename $$root);; esac; \
	  log=$(SYSTEST_LOGS)/$$label.log; start=$$(date +%s); \
	  echo "=== system tests on $$name (PERFECTSCHED_NS_ROOTFS=$$root)"; \
	  { env PATH=$(DEB_PATH) PERFECTSCHED_NS_ROOTFS=$$root \
	      PERFECTSCHED_OLD_DEB=$(CURDIR)/$(OLD_DEB) python3 -m pytest -v -rsP \
	      -p no:cacheprovider --noconftest --durations=0 -m system tests/system; \
	    echo $$? > $$log.rc; } 2>&1 | tee $$log; \
	  [ "$$(cat $$log.rc 2>/dev/null)" = 0 ] || rc=1; \
	  echo "$$name: $$(tail -n 1 $$log | sed 's/^=* *//; s/ *=*$$//') [$$(( $$(date +%s) - start )) s]" \
	    >> $(SYSTEST_LOGS)/summary; \
	done; \
	echo "=== test-system summary ($(SYSTEST_LOGS)/)"; cat $(SYSTEST_LOGS)/summary; exit $$rc

# --- benchmark: PerfectSched vs APScheduler 3.11 (docs/performance.md) -----------------
# APScheduler lives only in this venv, never in the project's dependencies.
# BENCH_ARGS, e.g.: --million, --backends sqlite, --quick, --only burst
BENCHVENV := .venv-bench
$(BENCHVENV)/bin/perfectschedd: pyproject.toml
	$(PYTHON) -m venv $(BENCHVENV)
	$(BENCHVENV)/bin/pip install -q --upgrade pip
	$(BENCHVENV)/bin/pip install -q 'apscheduler==3.11.*' sqlalchemy 'psycopg[binary]' \
	  py-spy pyinstrument
	$(BENCHVENV)/bin/pip install -q -e .
	touch $@

bench: $(BENCHVENV)/bin/perfectschedd
	env -u PYTHONPATH $(BENCHVENV)/bin/python bench/run.py $(BENCH_ARGS)
	env -u PYTHONPATH $(BENCHVENV)/bin/python bench/client_start.py
