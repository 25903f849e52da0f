#!/usr/bin/env python3
"""No library class declares more than 25 member functions (issue 59, item 4), except the ones
listed in CEILINGS, which may not grow past their figure there (lower it when a class shrinks;
remove the line when it is at 25 or below).

Counted: the member functions declared in a class or struct body in the library's headers and
sources (constructors, destructors and operators included; `= delete` and the accessors that
TORCH_ARG generates for options not; nested classes are counted on their own). Usage:
class_size_check.py <source root> [--list]. Prints every class over its limit and exits 1 when
there is one; --list prints every class over 25 with its count."""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from function_length_check import FOLDERS, SUFFIXES, strip  # noqa: E402

LIMIT = 25
# The classes allowed above the limit, each at its count (none since 2026-12-03: the six classes
# above 25 when this check was written were split; a class that must exceed it is listed here
# with a reason, and its figure may not grow).
CEILINGS = {}

CLASS_HEAD = re.compile(r"\b(class|struct)\s+(?:\[\[[^\]]*\]\]\s*)?([A-Za-z_][\w:]*)"
                        r"(?:\s+final)?\s*(?::[^;{]*)?$", re.S)
NOT_FUNCTIONS = ("using ", "friend ", "typedef ", "static_assert", "TORCH_ARG", "enum ", "class ",
                 "struct ")


def is_function(declaration):
    text = " ".join(declaration.split())
    text = re.sub(r"^(public|private|protected)\s*:\s*", "", text)
    text = re.sub(r"^template\s*<[^>]*>\s*", "", text)  # a member template: its declaration
    if not text or text.startswith(NOT_FUNCTIONS):
        return False
    if re.search(r"=\s*delete\s*$", text):
        return False
    # Template arguments hold parentheses of their own (std::function<void()>): drop them.
    while True:
        dropped = re.sub(r"<[^<>;]*>", "", text)
        if dropped == text:
            break
        text = dropped
    head = text.split("=", 1)[0] if not re.search(r"\boperator\b", text) else text
    return re.search(r"(\boperator\b[^(]*|[~\w]+)\s*\(", head) is not None


def classes(text):
    """{qualified name: member function count} of the class bodies in `text`."""
    code = strip(text)
    found = {}
    stack = []  # per open brace: (name or None, [count]) for class bodies, None otherwise
    statement = ""
    i = 0
    while i < len(code):
        c = code[i]
        body = stack[-1] if stack else None
        if c == "{":
            head = statement.strip()
            match = CLASS_HEAD.search(head)
            if match and not re.search(r"\benum\b", head):
                outer = [s[0] for s in stack if s is not None]
                name = "::".join(outer + [match.group(2)]) if body is not None else match.group(2)
                stack.append((name, [0]))
            else:
                if body is not None and is_function(head):
                    body[1][0] += 1
                stack.append(None)
            statement = ""
        elif c == "}":
            closed = stack.pop() if stack else None
            if closed is not None:
                found[closed[0]] = max(found.get(closed[0], 0), closed[1][0])
            statement = ""
        elif c == ";":
            if body is not None and is_function(statement):
                body[1][0] += 1
            statement = ""
        elif c == ":" and body is not None and re.search(
                r"\b(public|private|protected)\s*$", statement) and code[i + 1] != ":":
            statement = ""
        else:
            statement += c
        i += 1
    return found


def main():
    root = pathlib.Path(sys.argv[1])
    listing = "--list" in sys.argv[2:]
    counts = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file():
                for name, count in classes(path.read_text(errors="replace")).items():
                    counts[name] = max(counts.get(name, 0), count)
    over = []
    for name, count in sorted(counts.items(), key=lambda item: -item[1]):
        limit = CEILINGS.get(name, LIMIT)
        if listing and count > LIMIT:
            print(f"{name}: {count} member functions (limit {limit})")
        if count > limit:
            over.append(f"{name}: {count} member functions, above its limit of {limit}")
    stale = [name for name in CEILINGS if name not in counts]
    for line in over:
        print(line)
    for name in stale:
        print(f"{name}: in CEILINGS but no longer found (remove its line)")
    print(f"class size: {len(counts)} classes read, {len(over)} above their limit")
    return 1 if over or stale else 0


if __name__ == "__main__":
    sys.exit(main())
