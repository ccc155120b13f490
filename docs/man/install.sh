#!/bin/sh
# Install the man pages under PREFIX/share/man: section 1 (chm-serve) and section 3 (chm, one page per
# libchm function; pages named for a function documented with another are .so links to it).
#   docs/man/install.sh PREFIX        e.g. docs/man/install.sh "$HOME/.local"  (DESTDIR is honoured)
set -eu
if [ "$#" -ne 1 ] || [ -z "$1" ]; then
    echo "usage: $0 PREFIX" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
for section in 1 3; do
    dest="${DESTDIR:-}$1/share/man/man$section"
    install -d "$dest"
    install -m 0644 "$here/man$section"/*."$section" "$dest/"
done
