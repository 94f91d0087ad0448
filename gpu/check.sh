#!/usr/bin/env bash
# The GPU check in one command, for a bare GPU machine with no package registry:
#
#   gpu/check.sh [OUT]        OUT: folder for summary.txt, summary.json and every log
#                             (default: gpu-check in the repository, ignored by git)
#
# 1. installs the wheels gpu/wheels.sh fetched (gpu/wheels, or $MPIDIST_GPU_WHEELS) into a
#    scratch prefix: MPICH, mpi4py, pytest-mpi, the cudnn frontend; the repository itself runs
#    from its checkout;
# 2. runs gpu/check.py: `python -m mpidist info`, tests/test_gpu.py on 1 process and 2 ranks,
#    every strategy and layout on --device gpu against the same run on the CPU, and a short
#    benchmark (mpidist against torch on the GPU, layer by layer too, and a pipeline's activation
#    send by IPC and by MPI).
#
# Each part stops at its own limit (gpu/check_parts.py's LIMITS, under 8 minutes in all). Without a
# GPU the parts that need none still run and the rest are reported as not run.
#
# OUT must be a folder the check may fill: a new one, an empty one, or one a check wrote before
# (gpu/out_folder.py). A link, a file, a folder of other files or a place it cannot write is
# refused before anything is installed or written.
#
# Exit 0 when nothing failed, 1 when a part failed, 2 when the check could not start (no wheels
# to install, no Python, an OUT it may not fill, no scratch folder, a bad argument): one line
# on stderr says why.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
refuse() {
    echo "gpu/check.sh: error: $*" >&2
    exit 2
}
case ${1-} in
    -h | --help)
        sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"
        exit 0
        ;;
    -*) refuse "unknown option $1 (usage: gpu/check.sh [OUT]; a folder named so: ./$1)" ;;
esac
(($# <= 1)) || refuse "one OUT folder at most, not $# arguments (usage: gpu/check.sh [OUT])"
out=${1:-$repo/gpu-check}
wheels=${MPIDIST_GPU_WHEELS:-$here/wheels}
python=${PYTHON:-python3}
command -v "$python" >/dev/null || refuse "no Python named $python (PYTHON names the one to run)"
if ! compgen -G "$wheels/*.whl" >/dev/null; then
    refuse "no wheels in $wheels: run gpu/wheels.sh there first (on a machine with a registry)"
fi
# (out_folder.py says why in one line where it refuses; nothing is written before OUT is the check's)
out=$("$python" "$here/out_folder.py" "$out") || exit 2
scratch=$(mktemp -d "${TMPDIR:-/tmp}/mpidist-gpu.XXXXXX" 2>/dev/null) ||
    refuse "cannot make a scratch folder in ${TMPDIR:-/tmp} (TMPDIR names where)"
trap 'rm -rf "$scratch"' EXIT
start=$SECONDS
# --ignore-installed: a package of the same version already there would otherwise be skipped,
# and the check would run whatever MPI that one finds.
timeout 45 "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --ignore-installed --disable-pip-version-check --prefix "$scratch" "$wheels"/*.whl >"$out/install.log" 2>&1
installed=$?
# Where pip put things depends on the Python (lib/ or lib64/, a local/ level on Debian's): find
# mpi4py, mpiexec and libmpi rather than assume.
found() { find "$scratch" -maxdepth 6 "$@" -print -quit; }
site=$(found -type d -name mpi4py)
launcher=$(found -type f -name mpiexec)
libmpi=$(found -name libmpi.so.12)
if [ -z "$site" ] || [ -z "$launcher" ] || [ -z "$libmpi" ]; then
    echo "gpu/check.sh: the wheels in $wheels did not give mpi4py, mpiexec and libmpi for $("$python" -V)" \
        >>"$out/install.log"
    [ "$installed" = 0 ] && installed=3
else
    export PYTHONPATH="$repo:$(dirname "$site")${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$(dirname "$launcher"):$PATH"
    export LD_LIBRARY_PATH="$(dirname "$libmpi")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # mpi4py looks for libmpi in its own environment first: name the carried one, so the check
    # runs the MPI it installed and `info` shows which.
    export MPI4PY_LIBMPI="$libmpi"
fi
export PYTHONUNBUFFERED=1
"$python" "$here/check.py" --out "$out" --install-exit "$installed" --install-seconds $((SECONDS - start))
