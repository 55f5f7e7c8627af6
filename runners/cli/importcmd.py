"""`vigil import`: another supervisor's configuration as a hosts file (runners/imports/)."""

from __future__ import annotations

import os
import tempfile

import click

FORMATS = ("supervisord", "procfile", "pm2", "process-compose")


@click.command("import")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="The file's format (default: from its name: supervisord.conf or *.conf, "
                   "Procfile, ecosystem.config.js/.json, process-compose.yaml).")
@click.option("-o", "--output", default=None,
              help="Write the hosts file here (default: standard output).")
@click.option("--apply", "then_apply", is_flag=True,
              help="Then `vigil apply` the written file (needs -o).")
@click.pass_context
def import_cmd(ctx: click.Context, file: str, fmt: str | None, output: str | None,
               then_apply: bool) -> None:
    """Write a hosts file from a supervisord.conf, Procfile, PM2 ecosystem file or
    process-compose.yaml: every key that maps is mapped, each that does not is listed on
    stderr (and atop the file) with why (docs/guides/coming-over.md)."""
    from models.errors import BadInput
    from runners.cli.hostfile import BUILD, KEYS, LISTEN, RUNNING
    from runners.imports.formats import read
    from runners.imports.tomlwrite import render

    if then_apply and output is None:
        raise BadInput("--apply applies the written file: there is none without -o",
                       "add -o hosts.toml")
    imported = read(file, fmt)
    imported.keep_known({BUILD, LISTEN, RUNNING, *KEYS})  # a key this vigil lacks is listed
    out_dir = os.path.dirname(os.path.abspath(output)) if output else None
    text = render(imported, out_dir)
    for line in imported.unmapped:
        click.echo(f"vigil import: not imported: {line}", err=True)
    if output is None:
        click.echo(text, nl=False)
        return
    _write(output, text)
    click.echo(f"wrote {output}: {len(imported.programs)} hosts, "
               f"{len(imported.unmapped)} keys not imported", err=True)
    if then_apply:
        from runners.cli.hostcmds import apply_cmd

        ctx.invoke(apply_cmd, file=output, dry_run=False)


def _write(path: str, text: str) -> None:
    """Whole or not at all: a temporary file beside it, renamed over it."""
    from models.errors import BadInput

    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".vigil-import.", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror}",
                       "pass -o a path in a writable directory") from None
    finally:
        if tmp is not None:  # a full disk, say: no half file left beside it
            os.unlink(tmp)
