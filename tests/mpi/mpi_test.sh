#!/usr/bin/env bash
# Distributed conversion and saving under MPI (Debian's OpenMPI): the same bytes whatever the
# process count, and a failure in one process fails all of them with no output left.
#  1. examples/mpi_save_restore with 1, 2 and 4 processes: each process saves its own ranks
#     through one RankSaver; the three checkpoints are identical file by file.
#  2. `ucp convert`, `ucp extract` and `ucp reshard` under mpirun -np 2 and 3 give the files a
#     single process gives, byte for byte.
#  3. A flipped byte in a source shard: every process exits 6 (data loss), nothing at DST.
set -euo pipefail
bin=$1
example=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# The test runs as root in CI, on 2 cores; shared memory only, no network.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
mpi() { local n=$1; shift; mpirun -np "$n" "$@"; }
same() {  # folder A, folder B: the same files with the same bytes
  (cd "$1" && find . -type f | sort) >a.list
  (cd "$2" && find . -type f | sort) >b.list
  cmp -s a.list b.list || { echo "file lists differ: $1 vs $2"; diff a.list b.list; exit 1; }
  while read -r f; do cmp "$1/$f" "$2/$f" || exit 1; done <a.list
}

"$example" s1 >/dev/null
mpi 2 "$example" s2 >/dev/null
mpi 4 "$example" s4 >/dev/null
same s1/step1000 s2/step1000
same s1/step1000 s4/step1000
echo "RankSaver under 1, 2 and 4 processes: identical checkpoints"

"$bin/ucp" generate --model llama-tiny --layout tp=2,pp=2,dp=2,zero=1 --seed 5 --out src >/dev/null
"$bin/ucp" convert src c1 --layout tp=4,pp=1,dp=2,zero=2 >/dev/null
mpi 3 "$bin/ucp" convert src c3 --layout tp=4,pp=1,dp=2,zero=2 >/dev/null
same c1 c3
"$bin/ucp" extract src u1 >/dev/null
mpi 2 "$bin/ucp" extract src u2 >/dev/null
same u1 u2
"$bin/ucp" reshard u1 r1 --layout tp=1,pp=2,dp=4,zero=1 >/dev/null
mpi 3 "$bin/ucp" reshard u1 r3 --layout tp=1,pp=2,dp=4,zero=1 >/dev/null
same r1 r3
"$bin/ucp" verify c3 >/dev/null
echo "convert (3 processes), extract (2), reshard (3): identical to one process"

cp -r src bad
/usr/bin/python3 - <<'PY'
import h5py
path = "bad/rank_00005.h5"
with h5py.File(path, "r") as f:
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    offset = f[names[-1]].id.get_offset()
data = bytearray(open(path, "rb").read())
data[offset] ^= 0x40
open(path, "wb").write(data)
PY
set +e
mpi 3 "$bin/ucp" convert bad out --layout tp=4,pp=1,dp=2,zero=1 2>err.txt >/dev/null
rc=$?
set -e
[ $rc -eq 6 ] || { echo "expected exit 6, got $rc"; cat err.txt; exit 1; }
grep -q 'ucp convert: error: process [0-9]: bad/rank_00005.h5: tensor ".*": checksum' err.txt || {
  cat err.txt; exit 1; }
[ "$(ls | grep -c '^out')" = 0 ] || { echo "output left behind"; ls; exit 1; }
echo "a corrupt shard fails every process with exit 6 and leaves no output"
