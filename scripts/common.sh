# Shell functions shared by the install scripts (sourced, not run). They expect $PYTHON and, for the
# package functions, the repo root as the working directory.

# After each install into an environment that holds the oracle, pip reports chatterbox-tts's own pins (torch
# 2.6, numpy<2, gradio, ...) as conflicts. They are known and deliberately not met (install_oracle.sh), so
# that report is dropped; any other line still shows (on stderr).
known_conflicts() {
    grep -v -e "^ERROR: pip's dependency resolver does not currently take into account" \
        -e "^chatterbox-tts 0\.1\.7 requires " -e "^s3tokenizer 0\.3\.0 requires " >&2 || true
}

# The key of an editable install of this checkout with extras $1: pyproject.toml's hash, the extras, the
# folder.
_package_key() {
    "$PYTHON" -c 'import hashlib, os, sys
print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest(), sys.argv[1], os.getcwd())' "$1"
}

_package_stamp() {
    printf '%s/.mlx-chatterbox-install[%s]' "$("$PYTHON" -c 'import sys; print(sys.prefix)')" "$1"
}

# True when this checkout is installed (editable) in $PYTHON's environment with extras $1 and pyproject.toml
# has not changed since (a stamp in the environment that install_package writes).
package_installed() {
    local stamp
    stamp=$(_package_stamp "$1")
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(_package_key "$1")" ]
}

# pip install -e ".[$1]" (just "." without extras) into $PYTHON's environment, with an up-to-date pip, unless
# package_installed says it is there already.
install_package() {
    package_installed "$1" && return 0
    local spec=.
    [ -n "$1" ] && spec=".[$1]"
    "$PYTHON" -m pip install -q --upgrade pip 2>&1 | known_conflicts
    "$PYTHON" -m pip install -q -e "$spec" 2>&1 | known_conflicts
    _package_key "$1" >"$(_package_stamp "$1")"
}
