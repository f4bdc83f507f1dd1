#!/usr/bin/env python3
"""Validates every rule set patterns/*.json and preset patterns/models/*.json against its schema."""
import json
import pathlib
import sys

import jsonschema


def main(root: pathlib.Path) -> int:
    failures = 0
    checks = [("pattern_set.schema.json", sorted((root / "patterns").glob("*.json"))),
              ("model.schema.json", sorted((root / "patterns" / "models").glob("*.json")))]
    for schema_name, files in checks:
        schema = json.loads((root / "schemas" / schema_name).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        validator = jsonschema.Draft202012Validator(schema)
        if not files:
            print(f"no files for {schema_name}")
            failures += 1
        for f in files:
            errors = list(validator.iter_errors(json.loads(f.read_text())))
            for e in errors:
                print(f"{f}: {list(e.absolute_path)}: {e.message}")
            failures += bool(errors)
            print(f"{f}: {'ok' if not errors else 'invalid'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
