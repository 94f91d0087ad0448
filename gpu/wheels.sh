#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels gpu/check.sh installs on a
# bare GPU machine that has none: an MPI runtime (MPICH), mpi4py built for it,
# pytest-mpi, and NVIDIA's cudnn frontend (its Python graph API: the convolutions' cuDNN
# path; the machine has cuDNN's library, nvidia-cudnn-cu13, and cuda-bindings, and the
# convolutions need none of the frontend's other requirements). Everything else the check needs (cupy, torch, numpy, h5py, pytest, tqdm,
# threadpoolctl) is expected there already.
#
#   gpu/wheels.sh [DIR]      DIR defaults to gpu/wheels (ignored by git)
#
# MPIDIST_WHEELS_PYTHON picks the target interpreter's version (default 3.12, the GPU
# machine's); the platform is manylinux x86_64. PYTHON names the interpreter whose pip
# fetches them (default python3). The wheels must stay within 40 MiB,
# the share of the working tree a GPU call can carry that this check may take.
#
# The download goes to a new folder beside DIR; only once it succeeded and fits are the
# wheels an earlier run wrote in DIR (the names its list, .wheels.sh-wrote, holds) replaced
# by the new ones, so a failed download leaves DIR as it was. Nothing else in DIR is removed
# or overwritten: another file is left with a note (check.sh installs every wheel in DIR),
# and a DIR that is a symbolic link is refused. Exit 0 when DIR holds the new wheels, 1 when
# the download failed or is too large or a wheel met another file of its name in DIR, 2 for a
# DIR it may not use; one line on stderr says why.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-$here/wheels}
while [[ $dir == */ && $dir != / ]]; do dir=${dir%/}; done # ("link/" would be looked at through the link)
python_version=${MPIDIST_WHEELS_PYTHON:-3.12}
limit_mib=40
wrote=.wheels.sh-wrote # the wheels this script wrote in DIR, one name a line
say() { echo "gpu/wheels.sh: $*" >&2; }
fail() {
    local code=$1
    shift
    say "error: $*"
    exit "$code"
}
plain_file() { [ -f "$1" ] && [ ! -L "$1" ]; }
there() { [ -e "$1" ] || [ -L "$1" ]; }
placed=() kept=()
is_placed() {
    local name
    for name in "${placed[@]}"; do
        [ "$name" != "$1" ] || return 0
    done
    return 1
}
(($# <= 1)) || fail 2 "one DIR at most, not $# arguments (usage: gpu/wheels.sh [DIR])"
[ ! -L "$dir" ] || fail 2 "$dir is a symbolic link (to $(readlink "$dir")): name the folder itself"
[ ! -e "$dir" ] || [ -d "$dir" ] || fail 2 "$dir exists and is not a folder"
if there "$dir/$wrote" && ! plain_file "$dir/$wrote"; then
    fail 2 "$dir/$wrote is not the list of wheels this script writes (a plain file)"
fi
parent=$(dirname "$dir")
mkdir -p "$parent" 2>/dev/null || fail 2 "cannot make $parent"
new=$(mktemp -d "$parent/.wheels.XXXXXX" 2>/dev/null) || fail 2 "cannot write in $parent"
trap 'rm -rf "$new"' EXIT # (made by mktemp, holding what pip wrote: ours alone)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# One version of each: pinned to what the project is tested with, so the GPU machine
# runs the MPI the CPU suite ran.
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
    --python-version "$python_version" "${platforms[@]}" -d "$new" \
    'mpich==5.0.2' 'mpi4py==4.1.2' 'pytest-mpi==0.6' 'nvidia-cudnn-frontend==1.32.0' ||
    fail 1 "pip download failed (exit $?): $dir left as it was"
names=()
for wheel in "$new"/*.whl; do
    if plain_file "$wheel"; then
        names+=("$(basename "$wheel")")
    fi
done
((${#names[@]})) || fail 1 "pip download wrote no wheel: $dir left as it was"
size_mib=$(($(du -sk "$new" | cut -f1) / 1024))
if ((size_mib > limit_mib)); then
    fail 1 "the wheels hold $size_mib MiB, over the $limit_mib MiB a GPU call may carry: $dir left as it was"
fi
mkdir -p "$dir"
# The old wheels: the names the last run's list holds, each a plain name of a plain file (the list is a file
# like any other: a name that leads out of DIR, or to a link, is passed over).
if plain_file "$dir/$wrote"; then
    while IFS= read -r name; do
        case $name in
            .* | *[!A-Za-z0-9._+-]*) continue ;;
            *.whl) if plain_file "$dir/$name"; then rm -f -- "$dir/$name"; fi ;;
        esac
    done <"$dir/$wrote"
fi
for name in "${names[@]}"; do
    if ! there "$dir/$name"; then
        mv -- "$new/$name" "$dir/$name"
        placed+=("$name")
    elif plain_file "$dir/$name" && cmp -s "$new/$name" "$dir/$name"; then
        placed+=("$name") # (the same bytes, put there by hand or by an earlier wheels.sh: now on the list)
    else
        kept+=("$name")
    fi
done
printf '%s\n' "${placed[@]}" >"$new/$wrote"
mv -f -- "$new/$wrote" "$dir/$wrote"
for other in "$dir"/* "$dir"/.[!.]*; do
    name=${other##*/}
    if ! there "$other" || [ "$name" = "$wrote" ] || is_placed "$name"; then
        continue
    fi
    case $name in
        *.whl) say "note: left $other, which it did not write; check.sh installs every wheel in $dir" ;;
        *) say "note: left $other, which it did not write" ;;
    esac
done
if ((${#kept[@]})); then
    fail 1 "not placed in $dir, which holds another ${kept[*]} that this script did not write: move it away"
fi
echo "gpu/wheels.sh: ${#placed[@]} wheels, $size_mib MiB, in $dir (Python $python_version)"
