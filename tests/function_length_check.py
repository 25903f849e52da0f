#!/usr/bin/env python3
"""No library function is longer than 60 lines (issue 45): each function body, from the line of
its opening brace to the line of its closing brace, in the library's folders. Function bodies are
found as braces at namespace or class scope whose head ends in a parameter list; lambdas and
blocks inside a function count as part of it.

Usage: function_length_check.py <source root> [limit]. Prints every function over the limit and
exits 1 when there is one."""
import pathlib
import re
import sys

FOLDERS = ["amp", "distributor", "parallel", "preconditioners", "python", "shampoo", "update"]
SUFFIXES = {".h", ".cpp", ".cu", ".cuh", ".inc"}


def strip(text):
    """Comments, string and character literals blanked out, newlines kept."""
    out = re.sub(r"//[^\n]*", "", text)
    out = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), out, flags=re.S)
    out = re.sub(r'R"([^(]*)\((.*?)\)\1"', lambda m: '""' + "\n" * m.group(0).count("\n"),
                 out, flags=re.S)
    out = re.sub(r'"(\\.|[^"\\\n])*"', '""', out)
    out = re.sub(r"'(\\.|[^'\\\n])*'", "''", out)
    return out


def functions(text):
    """(first line, line count, head) of each function body at namespace or class scope."""
    code = strip(text)
    scopes = []  # "space" (namespace, class, extern) or "other"
    head_start = 0
    line = 1
    i = 0
    while i < len(code):
        c = code[i]
        if c == "\n":
            line += 1
        elif c in ";":
            head_start = i + 1
        elif c == "}":
            if scopes:
                scopes.pop()
            head_start = i + 1
        elif c == "{":
            head = code[head_start:i]
            at_scope = all(s == "space" for s in scopes)
            words = set(re.findall(r"[A-Za-z_]\w*", head))
            if words & {"namespace", "class", "struct", "union", "enum"} and "(" not in head:
                scopes.append("space")
            elif 'extern ""' in head:
                scopes.append("space")
            elif at_scope and re.search(r"\)\s*(const|override|final|noexcept|mutable|->[^{]*|"
                                        r":[^{]*|\s)*$", head) and "=" not in head.split("(")[0]:
                # A function body: skip to its matching brace.
                start, depth, j = line, 0, i
                while j < len(code):
                    if code[j] == "{":
                        depth += 1
                    elif code[j] == "}":
                        depth -= 1
                        if depth == 0:
                            break
                    elif code[j] == "\n":
                        line += 1
                    j += 1
                yield start, line - start + 1, " ".join(head.split())[-90:]
                i = j
                head_start = j + 1
            else:
                scopes.append("other")
            if scopes and scopes[-1] != "function":
                head_start = i + 1
        i += 1


def main():
    root = pathlib.Path(sys.argv[1])
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    long = []
    count = 0
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES:
                continue
            for start, length, head in functions(path.read_text(errors="replace")):
                count += 1
                if length > limit:
                    long.append(f"{path.relative_to(root)}:{start}: {length} lines: {head}")
    for entry in long:
        print(entry)
    print(f"function length: {count} function bodies read, {len(long)} over {limit} lines")
    return 1 if long or count == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
