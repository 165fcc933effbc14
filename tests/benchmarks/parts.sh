#!/bin/bash
# A folder larger than one device call moves (64 MiB carried in, 4 files of 16 MiB back), moved in 15 MiB parts
# over consecutive calls on one warm machine. For the mission's trained target (launch/mission_target.py): 7
# device-minutes on every fresh machine, made once, brought back here, and carried to later machines instead.
#
#   on the GPU machine, once the folder is made (one call per 4 parts; FIRST = 0, 4, 8, ...; each prints the next):
#     bash tests/benchmarks/parts.sh out NAME FIRST DIR PATH...   (PATHs inside DIR; parts + NAME.sha256 to $OUT/NAME)
#   here, after each such call: mkdir -p .parts/NAME-FIRST && cp FILES_AT/NAME/* .parts/NAME-FIRST/
#   on a later machine: one call carrying .whl and .sgl, then one call per .parts/NAME-FIRST folder (git ignores
#   .parts/; a folder carried earlier stays on the warm machine), then
#     bash tests/benchmarks/parts.sh in NAME DIR   (checks every part's sha256, unpacks into DIR; exit 1: parts missing)
# tests/benchmarks/mission.sh unpacks .parts/mission-assets-* into runs/mission/assets when they are all there.
# env: PARTS_MIB (part size, default 15), PARTS_TMP (where `out` packs, default /tmp/parts); tests/test_parts.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_BYTES=$((${PARTS_MIB:-15} * 1024 * 1024))  # 4 parts and the manifest: within the 64 MiB a call returns

case "${1:-}" in
  out)
    name=$2 first=$3 dir=$4; shift 4
    parts=${PARTS_TMP:-/tmp/parts}/$name
    if [ ! -f "$parts/$name.sha256" ]; then  # packed once per machine: every call returns parts of the same archive
      rm -rf "$parts" && mkdir -p "$parts"
      tar -C "$dir" -cf - "$@" | split -b $PART_BYTES -d -a 3 - "$parts/$name.tar."
      (cd "$parts" && sha256sum "$name".tar.* > "$name.sha256.tmp" && mv "$name.sha256.tmp" "$name.sha256")
    fi
    mapfile -t all < <(cd "$parts" && ls "$name".tar.*)
    [ "$first" -lt ${#all[@]} ] || { echo "parts.sh: $name has ${#all[@]} parts: none from $first" >&2; exit 1; }
    mkdir -p "${OUT:?the device machine sets OUT}/$name"
    cp "$parts/$name.sha256" "$OUT/$name/"
    for part in "${all[@]:$first:4}"; do cp "$parts/$part" "$OUT/$name/"; done
    next=$((first + 4))
    echo "parts.sh: $name: parts $first-$((next > ${#all[@]} ? ${#all[@]} - 1 : next - 1)) of ${#all[@]} in" \
      "\$OUT/$name; $([ $next -lt ${#all[@]} ] && echo "next FIRST: $next" || echo "that was the last")"
    ;;
  in)
    name=$2 dir=$3
    [ -f "$dir/parts-$name.sha256" ] && { echo "parts.sh: $name already unpacked in $dir"; exit 0; }
    manifest=$(ls .parts/*/"$name.sha256" 2>/dev/null | head -1 || true)
    [ -n "$manifest" ] || { echo "parts.sh: no .parts/*/$name.sha256: nothing of $name was carried" >&2; exit 1; }
    missing=0
    while read -r sum part; do
      found=$(ls .parts/*/"$part" 2>/dev/null | head -1 || true)
      if [ -z "$found" ]; then echo "parts.sh: $part not carried yet" >&2; missing=1
      elif [ "$(sha256sum < "$found" | cut -d' ' -f1)" != "$sum" ]; then
        echo "parts.sh: $found: damaged (its sha256 is not the manifest's)" >&2; exit 1
      fi
    done < "$manifest"
    [ $missing = 0 ] || exit 1
    mkdir -p "$dir"
    while read -r _ part; do cat "$(ls .parts/*/"$part" | head -1)"; done < "$manifest" | tar -C "$dir" -xf -
    cp "$manifest" "$dir/parts-$name.sha256"  # where it came from: the parts' checksums
    echo "parts.sh: $name unpacked into $dir ($(wc -l < "$manifest") parts)"
    ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
