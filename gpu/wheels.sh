#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels gpu/check.sh installs on a
# bare GPU machine that has none: an MPI runtime (MPICH), mpi4py built for it, and
# pytest-mpi. Everything else the check needs (cupy, torch, numpy, h5py, pytest, tqdm,
# threadpoolctl) is expected there already.
#
#   gpu/wheels.sh [DIR]      DIR defaults to gpu/wheels (ignored by git)
#
# MPIDIST_WHEELS_PYTHON picks the target interpreter's version (default 3.12, the GPU
# machine's); the platform is manylinux x86_64. PYTHON names the interpreter whose pip
# fetches them (default python3). The wheels must stay within 40 MiB,
# the share of the working tree a GPU call can carry that this check may take.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-$here/wheels}
python_version=${MPIDIST_WHEELS_PYTHON:-3.12}
limit_mib=40
mkdir -p "$dir"
rm -f "$dir"/*.whl   # (check.sh installs every wheel there: one version of each, for one Python)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# One version of each: pinned to what the project is tested with, so the GPU machine
# runs the MPI the CPU suite ran.
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
    --python-version "$python_version" "${platforms[@]}" -d "$dir" \
    'mpich==5.0.2' 'mpi4py==4.1.2' 'pytest-mpi==0.6'
size_mib=$(( $(du -sk "$dir" | cut -f1) / 1024 ))
if (( size_mib > limit_mib )); then
    echo "gpu/wheels.sh: $dir holds $size_mib MiB, over the $limit_mib MiB a GPU call may carry" >&2
    exit 1
fi
echo "gpu/wheels.sh: $(ls "$dir" | wc -l) wheels, $size_mib MiB, in $dir (Python $python_version)"
