#!/usr/bin/env python3
"""Every source file of a library folder is named in that folder's README.md, or in its
sub-folder's when the sub-folder has one (parallel/'s), so that a new file without a line there
fails `make test` (issue 59). A file is named by its name or its path below the README's folder,
in backquotes; `name.{h,cpp}` names both files, `cuda/*.cu`-style globs are not used.

Usage: readme_files_check.py <source root>. Prints every file its README does not name and
exits 1 when there is one."""
import pathlib
import re
import sys

FOLDERS = ["amp", "distributor", "parallel", "preconditioners", "python", "shampoo", "update"]
SUFFIXES = {".h", ".cpp", ".cu", ".cuh", ".inc", ".py"}
QUOTED = re.compile(r"`([^`\n]+)`")
BRACES = re.compile(r"^(.*)\{([^{}]+)\}(.*)$")


def expand(token):
    """`a.{h,cpp}` -> a.h, a.cpp (nested once is enough for this tree)."""
    match = BRACES.match(token)
    if not match:
        return [token]
    head, options, tail = match.groups()
    return [out for option in options.split(",") for out in expand(head + option.strip() + tail)]


def named(readme_text):
    names = set()
    for token in QUOTED.findall(readme_text):
        # Words split at spaces, and at commas outside braces (`a.{h,cpp}` stays one word).
        for word in re.split(r"\s+|,(?![^{]*\})", token):
            names.update(expand(word.strip()))
    return names


def main():
    root = pathlib.Path(sys.argv[1])
    missing = []
    for folder in FOLDERS:
        base = root / folder
        if not (base / "README.md").exists():
            missing.append(f"{folder}/: no README.md")
            continue
        for path in sorted(base.rglob("*")):
            if path.suffix not in SUFFIXES or "__pycache__" in path.parts:
                continue
            # The README nearest above the file: a sub-folder with its own README (parallel/'s)
            # names its files there, by name or path below it.
            holder = path.parent
            while holder != base and not (holder / "README.md").exists():
                holder = holder.parent
            readme = holder / "README.md"
            relative = path.relative_to(holder).as_posix()
            if path.name not in named(readme.read_text()) and relative not in named(
                    readme.read_text()):
                missing.append(f"{path.relative_to(root).as_posix()}: not named in "
                               f"{readme.relative_to(root).as_posix()}")
    for line in missing:
        print(line)
    print(f"folder READMEs: {len(missing)} file(s) not named")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
