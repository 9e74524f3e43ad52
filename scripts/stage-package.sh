# Sourced by typecheck.sh and lint-imports.sh. Tools that read the source rather than
# import it (mypy, import-linter's grimp) cannot follow setuptools' package-dir mapping
# (backends/ -> kvcached.backends, ...), so they are pointed at a staged tree of
# symlinks laid out like the installed package. Keep the folders below in step with
# [tool.setuptools.package-dir] in pyproject.toml.

# stage_package ROOT STAGE: STAGE/kvcached is the package as installed from ROOT.
stage_package() {
    local root=$1 stage=$2 entry folder
    mkdir -p "$stage/kvcached"
    for entry in "$root"/kvcached/*; do
        case "$(basename "$entry")" in __pycache__) continue ;; esac
        ln -s "$entry" "$stage/kvcached/"
    done
    for folder in backends engines apps conformance; do
        ln -s "$root/$folder" "$stage/kvcached/$folder"
    done
}
