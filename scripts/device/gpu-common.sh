# Sourced by scripts/device/gpu-bundle.sh and gpu-stage-rehearse.sh: what both do to stand in
# for the lent GPU machine here.

# find_python312: print a CPython 3.12 (the machine's interpreter) from PATH or pyenv's
# versions; fail when there is none.
find_python312() {
    local candidate
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

# write_stub_packages SITE FILE: the machine's packages (FILE: `name==version` lines) as
# installed dist-infos in SITE, name and version only, no dependencies (theirs are on the
# machine already), so pip takes them as satisfied and neither fetches nor replaces them.
write_stub_packages() {
    local site=$1 file=$2 line name version d
    grep -Ev '^\s*(#|$)' "$file" | while IFS= read -r line; do
        name=${line%%==*}
        version=${line#*==}
        version=${version%%+*}
        d="$site/${name//-/_}-$version.dist-info"
        mkdir -p "$d"
        printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$version" > "$d/METADATA"
        : > "$d/RECORD"
    done
}
