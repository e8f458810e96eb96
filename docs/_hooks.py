"""Adds the repository's executed notebooks to the site, so that they are
rendered from where they live (notebooks/) rather than copied into docs/."""

from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


# Before mkdocs-jupyter looks at the files, so that it renders these too.
@event_priority(100)
def on_files(files, config):
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        files.append(
            File(
                f"notebooks/{notebook.name}",
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
