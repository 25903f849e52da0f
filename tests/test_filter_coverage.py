#!/usr/bin/env python3
"""Every GoogleTest case of the folder test executables (tests/<folder>/<folder>_tests) is run by
some CTest test, and no CTest test's filter selects nothing: the filters that shampoo_add_test
(tests/CMakeLists.txt) derives from each source must cover the executable. Standard library only.
usage: test_filter_coverage.py <build dir>"""
import collections
import json
import re
import subprocess
import sys


def listed(exe, args):
    out = subprocess.run([exe, "--gtest_list_tests"] + args, capture_output=True, text=True,
                         check=True).stdout
    names, suite = set(), None
    for line in out.splitlines():
        if not line.startswith(" "):
            suite = line.split("#")[0].strip()
        else:
            names.add(suite + line.split("#")[0].strip())
    return names


def glob_matches(pattern, name):
    """GoogleTest's wildcards: '*' any run of characters, '?' one character, nothing else."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name) is not None


def selected_by(names, args):
    """The names a --gtest_filter argument selects, as GoogleTest selects them ("POSITIVE" or
    "POSITIVE-NEGATIVE", each a ':'-separated list of patterns); None for other arguments (the
    executable is asked then)."""
    if len(args) != 1 or not args[0].startswith("--gtest_filter="):
        return None
    text = args[0][len("--gtest_filter="):]
    positive, _, negative = text.partition("-")
    positives = [p for p in positive.split(":") if p] or ["*"]
    negatives = [p for p in negative.split(":") if p]
    return {n for n in names
            if any(glob_matches(p, n) for p in positives)
            and not any(glob_matches(p, n) for p in negatives)}


def main():
    build = sys.argv[1]
    data = json.loads(subprocess.run(["ctest", "--show-only=json-v1"], cwd=build,
                                     capture_output=True, text=True, check=True).stdout)
    by_exe = collections.defaultdict(list)
    for test in data["tests"]:
        command = test.get("command") or []
        if command and command[0].endswith("_tests"):
            by_exe[command[0]].append((test["name"], command[1:]))
    if not by_exe:
        print("no folder test executables registered")
        return 1
    failed = False
    for exe, tests in sorted(by_exe.items()):
        every = listed(exe, [])
        covered = set()
        for name, args in tests:
            # One listing per executable: each start of a test binary loads LibTorch (~0.4 s),
            # and the filters are matched here as GoogleTest matches them.
            selected = selected_by(every, args)
            if selected is None:
                selected = listed(exe, args)
            if not selected:
                print(f"{name}: its filter selects no test of {exe}")
                failed = True
            covered |= selected
        missing = sorted(every - covered)
        if missing:
            print(f"{exe}: {len(missing)} tests run by no CTest test, e.g. {missing[:5]}")
            failed = True
        print(f"{exe}: {len(every)} tests, {len(tests)} CTest tests")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
