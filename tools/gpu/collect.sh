#!/usr/bin/env bash
# Packs what the queue has produced so far into $OUT, for a poll call to bring back: the results
# folder, the EAGLE-1 and EAGLE-3 heads under the run folder (and a GPU1_VARIANT's) and the
# distilled parts, as one tar split into 15 MB parts (a call returns at most 8 files of 16 MiB)
# with their sha256. Run it at the end of every poll, so that a machine released early loses only
# what came after the last poll.
#   bash tools/gpu/collect.sh [STAGE_DIR]      (default /root/stage)
# On the development machine, in the call's files folder:
#   cat results.tar.part* > results.tar && sha256sum -c results.sha256 && tar -xf results.tar
set -e
stage=${1:-/root/stage}; out=${OUT:?OUT is where a call returns files}
cd "$stage"
# run/distill/*.npz: the tokens distilled on this machine (~5 MB per 2.7 M tokens), to be carried to
# the next one (stage_local.sh carries them; setup.sh unpacks them into run/distill, where the
# pipeline reuses every part it finds and a new DISTILL_SEED adds fresh ones beside them).
# The shipped kinds' heads only: the data-scaling runs' heads (run/scaling-*) stay, their rows come back.
# Parts that were carried in (setup.sh lists them in run/distill/.carried) are already here.
carried=$(cat run/distill/.carried 2>/dev/null || true)
new_parts=$(for part in run/distill/*.npz; do [ -f "$part" ] && ! grep -qx "$(basename "$part")" <<< "$carried" && echo "$part"; done; true)
paths=$(ls -d results run/eagle/head run/eagle3/head run/eagle3-variant/head 2>/dev/null || true)
paths="$paths $new_parts"; paths=${paths# }; paths=${paths% }
[ -n "${paths// }" ] || { echo "collect: nothing yet under $stage"; exit 0; }
rm -f "$out"/results.tar.part*
tar -cf - $paths | split -b 15000000 -d - "$out/results.tar.part"
cat "$out"/results.tar.part* | sha256sum | sed 's/-$/results.tar/' > "$out/results.sha256"
echo "collect: $(ls "$out"/results.tar.part* | wc -l) part(s) of $(du -ch "$out"/results.tar.part* | tail -1 | cut -f1): $paths" | tr '\n' ' '
echo
