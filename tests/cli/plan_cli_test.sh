#!/usr/bin/env bash
# `ucp plan` touches no file and prints a plan that agrees with itself: the JSON form's ops cover
# exactly the targets the summary counts, every op names valid tensors, and an impossible layout
# fails with exit 5 naming the parameter and the numbers.
set -euo pipefail
bin=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$bin/ucp" plan --model llama-tiny --from tp=2,pp=2,dp=2,zero=1 --to tp=4,pp=1,dp=2,zero=2 >summary.txt
"$bin/ucp" plan --model llama-tiny --from tp=2,pp=2,dp=2,zero=1 --to tp=4,pp=1,dp=2,zero=2 --json >plan.json
[ "$(ls)" = "$(printf 'plan.json\nsummary.txt')" ] || { echo "ucp plan wrote files"; exit 1; }
/usr/bin/python3 - <<'PY'
import json, re
plan = json.load(open("plan.json"))
summary = open("summary.txt").read()
m = re.search(r"(\d+) source tensors, (\d+) target tensors, (\d+) ops", summary)
assert m, summary
assert (len(plan["sources"]), len(plan["targets"]), len(plan["ops"])) == tuple(map(int, m.groups())), m.groups()
written = set()
for op in plan["ops"]:
    for s in op.get("srcs", []):
        assert 0 <= s["tensor"] < len(plan["sources"]), op
    if op["kind"] != "check_equal":
        assert 0 <= op["dst"]["tensor"] < len(plan["targets"]), op
        written.add(op["dst"]["tensor"])
assert written == set(range(len(plan["targets"]))), "a target tensor no op writes"
print("plan:", len(plan["targets"]), "targets,", len(plan["ops"]), "ops, all targets written")
PY
set +e
"$bin/ucp" plan --model llama-tiny --from tp=3 --to universal 2>err.txt
rc=$?
set -e
[ $rc -eq 5 ] || { echo "expected exit 5, got $rc"; cat err.txt; exit 1; }
grep -q 'parameter "layers.0.self_attention.query_key_value.weight": 4 query groups not divisible by tp=3' err.txt
echo "plan cli: ok"
