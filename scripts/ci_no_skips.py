#!/usr/bin/env python3
"""Fails (exit 1) when a ctest JUnit report (ctest --output-junit) lists a skipped test.

scripts/test.sh runs it in CI after the CPU test run, where no test may skip: every tool, model
and file a CPU test looks for is installed by scripts/setup.sh or fetched by scripts/test.sh.
Usage: scripts/ci_no_skips.py build/ctest-junit.xml
"""
import sys
import xml.etree.ElementTree as ElementTree


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        root = ElementTree.parse(sys.argv[1]).getroot()
    except (OSError, ElementTree.ParseError) as error:
        print(f"ci_no_skips: cannot read {sys.argv[1]}: {error}", file=sys.stderr)
        return 1
    cases = list(root.iter("testcase"))
    skipped = []
    for case in cases:
        mark = case.find("skipped")
        if mark is not None or case.get("status") in ("notrun", "disabled"):
            skipped.append((case.get("name"), (mark.get("message") if mark is not None else "")
                            or case.get("status")))
    if not cases:
        print(f"ci_no_skips: {sys.argv[1]} lists no tests", file=sys.stderr)
        return 1
    if skipped:
        print(f"ci_no_skips: {len(skipped)} of {len(cases)} tests skipped in CI "
              "(scripts/setup.sh or scripts/test.sh should have provided what they need):",
              file=sys.stderr)
        for name, why in skipped:
            print(f"  {name}: {why}", file=sys.stderr)
        return 1
    print(f"ci_no_skips: none of {len(cases)} tests skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
