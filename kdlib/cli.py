"""The `kdlib` console script: one sub-command per module, each parsing its own arguments.

    kdlib kdtr info FILE | kdtr convert A B | kdtr verify FILE
    kdlib report [NOTEBOOK ...] [--profile P] [-p NAME VALUE]
    kdlib memory CONFIG --gpu GPU --tp N --context T
    kdlib estimate [--scenario seeds] [--json]
    kdlib serve --port P
    kdlib diagnose [--endpoint URL]

Each module exposes `cli(argv: list[str]) -> int`; it is imported only when its command runs,
so a missing optional package (FastAPI on the GPU machine, say) breaks only that command.
"""

import importlib
import sys

COMMANDS = {
    "kdtr": ("kdlib.kdtr", "inspect and convert KDTR tensor files"),
    "report": ("kdlib.report", "run notebooks through papermill into reports/ (HTML + index)"),
    "memory": ("kdlib.memory", "KV-cache and weight memory plan from a config.json"),
    "estimate": ("kdlib.estimator", "step-time and throughput estimator"),
    "serve": ("kdlib.serve", "OpenAI-compatible HTTP server around the engine"),
    "diagnose": ("kdlib.diagnose", "throughput diagnosis of an OpenAI-compatible endpoint"),
}


def _usage() -> str:
    lines = ["usage: kdlib COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`kdlib COMMAND --help` shows a command's own arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kdlib: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.cli(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
