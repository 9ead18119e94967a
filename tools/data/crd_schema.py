"""Write a CustomResourceDefinition's openAPIV3Schema as JSON, for validating manifests offline.

    python tools/data/crd_schema.py CRD.yaml VERSION OUT.json

The schema is the one the API server checks objects of that version against. Descriptions are
left out (most of a CRD's bytes, and no part of validation); everything else is kept as it is.
deploy/schemas/README.md names where each shipped schema came from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml


def without_descriptions(node: Any) -> Any:
    """`node` with every schema's `description` dropped. A property that is itself called
    "description" stays: it sits under `properties`, where keys are field names, not keywords."""
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: without_descriptions(sub) for name, sub in value.items()}
        elif key != "description":
            out[key] = without_descriptions(value)
    return out


def version_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return dict(entry["schema"]["openAPIV3Schema"])
    names = [entry["name"] for entry in crd["spec"]["versions"]]
    raise SystemExit(f"crd_schema: {crd['metadata']['name']} has no version {version} ({names})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("version")
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    crd = next(doc for doc in yaml.safe_load_all(args.crd.read_text()) if doc)
    schema = without_descriptions(version_schema(crd, args.version))
    args.out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
