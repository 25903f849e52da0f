#!/usr/bin/env python3
"""Every relative link of the project's Markdown files resolves, so that moving a section (the
README's details into docs/, issue 59) cannot leave a dead link behind: `[text](path)` names a
file or folder that exists (relative to the linking file's folder), and `[text](path#anchor)` or
`[text](#anchor)` into a Markdown file names an anchor there, an explicit `<a id="...">` or
`<a name="...">` or a heading's GitHub slug (lowercase; characters other than letters, digits,
spaces, hyphens and underscores dropped; spaces become hyphens; a repeated slug gets -1, -2, ...).
Links to http(s) and mailto addresses, and links inside fenced code blocks or inline code, are
not checked. The files are those git tracks or would track (`git ls-files --cached --others
--exclude-standard '*.md'`: a new file is checked before it is committed), or, outside a git
checkout, every .md file below the root except in build/ and in folders whose name starts with
'.'.

Usage: docs_links_check.py <source root>. Prints every broken link and exits 1 when there is
one."""
import pathlib
import re
import subprocess
import sys
import urllib.parse

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# The "](target)" of [text](target) or ![alt](target), with an optional "title": found without
# its "[", whose text may have begun on an earlier line.
LINK = re.compile(r"\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                  r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
ANCHOR_TAG = re.compile(r"<a\s+[^>]*?(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def markdown_files(root):
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard", "*.md"],
                                capture_output=True, check=True, text=True).stdout
        return sorted(root / name for name in listed.split("\0") if name)
    except (OSError, subprocess.CalledProcessError):
        return sorted(path for path in root.rglob("*.md")
                      if not any(part == "build" or part.startswith(".")
                                 for part in path.relative_to(root).parts[:-1]))


def outside_fences(text):
    """(line number, line) for every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
            else:
                yield number, line
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not line.strip()[len(match.group(1)):]:
            fence = None


def prose_lines(text):
    """outside_fences, with inline code blanked."""
    for number, line in outside_fences(text):
        yield number, INLINE_CODE.sub(lambda code: " " * len(code.group(0)), line)


def slug(heading):
    """GitHub's anchor for a heading: markup gone, lowercase, punctuation dropped."""
    text = re.sub(r"<[^>]+>", "", heading)  # HTML tags
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = text.lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


ANCHORS = {}


def anchors(path):
    """The anchors a link into the Markdown file `path` may name (read once)."""
    if path not in ANCHORS:
        found = set()
        counts = {}
        for _, line in outside_fences(path.read_text(encoding="utf-8")):
            found.update(ANCHOR_TAG.findall(line))
            heading = HEADING.match(line)
            if heading:
                base = slug(heading.group(2))
                count = counts.get(base, 0)
                counts[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
        ANCHORS[path] = found
    return ANCHORS[path]


def targets(line):
    for match in LINK.finditer(line):
        yield match.group(1)
    reference = REFERENCE.match(line)
    if reference:
        yield reference.group(1)


def check(root, path):
    problems = []
    where = path.relative_to(root).as_posix()
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in targets(line):
            target = target.strip("<>")
            if not target or EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            file_part = urllib.parse.unquote(file_part)
            destination = (path.parent / file_part).resolve() if file_part else path
            if not destination.exists():
                problems.append(f"{where}:{number}: {target}: no file {file_part}")
                continue
            if anchor and destination.is_file() and destination.suffix == ".md":
                anchor = urllib.parse.unquote(anchor)
                known = anchors(destination)
                if anchor not in known and anchor.lower() not in known:
                    shown = destination.relative_to(root.resolve()).as_posix() \
                        if destination.is_relative_to(root.resolve()) else str(destination)
                    problems.append(f"{where}:{number}: {target}: no anchor #{anchor} in {shown}")
    return problems


def main():
    root = pathlib.Path(sys.argv[1]).resolve()
    files = markdown_files(root)
    problems = [problem for path in files if path.exists() for problem in check(root, path)]
    for line in problems:
        print(line)
    print(f"docs links: {len(problems)} broken link(s) in {len(files)} Markdown file(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
