"""Runs README.md's Python block marked `<!-- run: python-quickstart -->` as written, and checks
that its training lowered the loss. Usage: run_readme_quickstart.py README.md"""

import contextlib
import io
import re
import sys


def main(readme_path):
    text = open(readme_path).read()
    match = re.search(r"<!-- run: python-quickstart -->\n```python\n(.*?)```", text, re.S)
    if match is None:
        sys.exit("README.md: no ```python block after <!-- run: python-quickstart -->")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(match.group(1), "README.md quickstart", "exec"), {"__name__": "__main__"})
    print(output.getvalue(), end="")
    loss = float(re.search(r"loss after 100 steps: ([0-9.]+)", output.getvalue()).group(1))
    if not loss < 0.9:  # the targets have variance ~1: training must have lowered it
        sys.exit(f"the quickstart's loss {loss} did not go down")


if __name__ == "__main__":
    main(sys.argv[1])
