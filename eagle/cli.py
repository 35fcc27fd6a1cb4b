"""``eaglectl``: the command line over the engine (generate, bench, profile, prompts, head export).

Bad input exits with code 2 and one line on stderr; the generated text goes to stdout, logs and stats to
stderr. This module only parses arguments and formats output: the work is in the engine modules.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from eagle.bench import PROMPT_SETS
from eagle.compile import COMPILE_MODES
from eagle.policy import SPECULATE_MODES
from eagle.formats import EXPORT_FORMATS
from eagle.tree import TREE_KINDS

logger = logging.getLogger("eaglectl")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _add_model_args(parser: argparse.ArgumentParser, head_default: str) -> None:
    parser.add_argument("--target", default="smollm2-135m", help="built-in target name or local HF directory")
    parser.add_argument(
        "--head",
        default=head_default,
        help="head directory, a registry URI such as models:/<name>@<alias> (resolved by an installed "
        "eagle.head_resolvers plug-in), 'random' (untrained, fixed seed) or 'none' (plain decoding)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"],
        help="auto (default): bfloat16 on a GPU or a CPU that computes it natively (AMX, AVX512-BF16), else float32",
    )
    _add_device_arg(parser)
    parser.add_argument(
        "--tree", default="dynamic", choices=list(TREE_KINDS),
        help="draft tree policy: dynamic (EAGLE-2), static (EAGLE-1), auto (measured at start-up), hybrid (dynamic + an n-gram branch)",
    )
    parser.add_argument("--depth", type=_positive_int, default=None, help="dynamic / hybrid tree depth")
    parser.add_argument("--top-k-draft", type=_positive_int, default=None, help="dynamic / hybrid tree top-k")
    parser.add_argument("--total-tokens", type=_positive_int, default=None, help="dynamic / hybrid tree size")
    parser.add_argument("--branch-tokens", type=_positive_int, default=None, help="hybrid tree: longest n-gram branch")
    parser.add_argument(
        "--compile", default="on", choices=list(COMPILE_MODES),
        help="on: torch.compile the decoder's hot functions (paid once at start-up); off: run them eagerly",
    )
    parser.add_argument(
        "--speculate", default="auto", choices=list(SPECULATE_MODES),
        help="auto: draft only in steps where this machine's measured costs and the head's acceptance say it pays "
             "(else decode plainly); always: draft every step; never: plain decoding",
    )
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")


def _add_device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the target and head run")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="eaglectl", description="EAGLE speculative decoding: generate and benchmark",
        epilog="with eagle-platform installed, also: eaglectl targets ... (onboard/list/status/retrain/retire/promote/rollback), eaglectl platform serve",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser("generate", help="generate text with a target (and a head)")
    _add_model_args(generate, head_default="none")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="raw prompt text")
    prompt.add_argument("--chat", help="one user message, rendered with the target's chat template")
    _add_sampling_args(generate)
    generate.add_argument("--stream", action="store_true", help="print text as it is accepted")
    generate.add_argument("--json", action="store_true", help="print a JSON record instead of the text")

    bench = commands.add_parser("bench", help="side-by-side benchmark: plain, EAGLE, HF generate, prompt lookup")
    _add_model_args(bench, head_default="random")
    _add_sampling_args(bench)
    source = bench.add_mutually_exclusive_group()
    source.add_argument("--prompts", default=None, help="JSONL of prompts (default: MT-bench question.jsonl)")
    source.add_argument("--prompt-set", default=None, choices=list(PROMPT_SETS), help="a named set (eagle.bench.prompt_set)")
    bench.add_argument("--limit", type=_positive_int, default=None, help="first N prompts only")
    bench.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    bench.add_argument("--baselines", default="hf,prompt-lookup", help="comma list of hf, prompt-lookup, or ''")
    bench.add_argument("--out", required=True, help="result JSON path (.md and .png are written beside it)")

    prompts = commands.add_parser("prompts", help="write a named prompt set as token ids (what every benchmarked engine reads)")
    prompts.add_argument("--set", required=True, choices=list(PROMPT_SETS), dest="prompt_set")
    prompts.add_argument("--target", default="smollm2-135m")
    prompts.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="for the rewrite set's first answers")
    _add_device_arg(prompts)
    prompts.add_argument("--limit", type=_positive_int, default=None)
    prompts.add_argument("--out", required=True)

    head = commands.add_parser("head", help="head checkpoints: export to the layouts other engines load")
    head_commands = head.add_subparsers(dest="head_command", required=True, parser_class=_Parser)
    export = head_commands.add_parser("export", help="write a head directory in vLLM's, SGLang's, SafeAILab EAGLE's or speculators' layout")
    export.add_argument("--to", required=True, dest="fmt", choices=list(EXPORT_FORMATS), help="the layout to write")
    export.add_argument(
        "--verifier", default=None,
        help="speculators: the target's Hugging Face id or directory written as its verifier (default: the head's target, resolved here)",
    )
    export.add_argument("source", help="head directory (ours) or a registry URI such as models:/<name>@<alias>")
    export.add_argument("dest", help="new directory to write")

    profile = commands.add_parser("profile", help="time one target forward over tree sizes and one draft step")
    profile.add_argument("--target", default="smollm2-135m")
    profile.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _add_device_arg(profile)
    profile.add_argument("--sizes", default="1,8,16,32,64", help="tree tokens per verification forward")
    profile.add_argument("--context", type=_positive_int, default=256, help="cached tokens before the forward")
    profile.add_argument("--repeats", type=_positive_int, default=10)
    profile.add_argument("--draft-vocab", default="", help="comma list of draft vocabulary sizes to time")
    profile.add_argument("--threads", type=_positive_int, default=None)
    profile.add_argument("--compile", default="off", choices=list(COMPILE_MODES), help="time the compiled functions (and their compile)")
    profile.add_argument("--out", default=None, help="write the timings as JSON")
    return parser


def _tree(args):
    from eagle.tree import build_tree

    return build_tree(args.tree, depth=args.depth, top_k=args.top_k_draft, total_tokens=args.total_tokens, branch_tokens=args.branch_tokens)


HEAD_RESOLVERS_GROUP = "eagle.head_resolvers"


def resolve_head_spec(spec: str) -> str:
    """A ``--head`` value as a local directory. A URI (``<scheme>://...`` or ``models:/...``) goes to the
    resolver registered for its scheme in the ``eagle.head_resolvers`` entry-point group (eagle-platform
    registers ``models`` -> ``eagle_platform.registry:resolve_head``), which returns a local directory; the
    engine itself never talks to a registry. Anything else is already a directory."""
    if "://" not in spec and not spec.startswith("models:/"):
        return spec
    from importlib.metadata import entry_points

    from eagle.errors import EagleError

    scheme = spec.split(":", 1)[0]
    resolvers = {ep.name: ep for ep in entry_points(group=HEAD_RESOLVERS_GROUP)}
    if scheme not in resolvers:
        known = ", ".join(sorted(resolvers)) or "none installed"
        raise EagleError(f"no head resolver for {scheme}: URIs ({HEAD_RESOLVERS_GROUP} plug-ins: {known})")
    try:
        resolver = resolvers[scheme].load()
    except ImportError as err:
        raise EagleError(f"head resolver {scheme!r} ({resolvers[scheme].value}) cannot be imported: {err}") from None
    try:
        return str(resolver(spec))
    except EagleError:
        raise
    except ValueError as err:  # resolvers report bad input as ValueError subclasses (e.g. RegistryError)
        raise EagleError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None


def _load(args):
    from eagle.head import EagleHead
    from eagle.target import load_target

    from eagle.formats import weights_files

    head_dir = None if args.head in ("none", "random") else resolve_head_spec(args.head)  # fail before the load
    if head_dir is not None:
        weights_files(head_dir)  # a directory without safetensors weights fails before the target loads
    from eagle.runtime import preferred_dtype

    target = load_target(args.target, dtype=preferred_dtype(args.dtype, gpu=args.device != "cpu"), device=args.device)
    if args.head == "none":
        head = None
    elif args.head == "random":
        head = EagleHead.for_target(target, seed=0)
    else:
        head = EagleHead.from_pretrained(head_dir, target)
    return target, head


def _sampling(args):
    from eagle.generate import GenerationConfig
    from eagle.verify import SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    return sampling, GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)


def _decoder(args, target, head):
    """The decoder with its functions compiled (or run once eagerly) and an auto tree resolved; logs both."""
    from eagle.generate import Decoder

    decoder = Decoder(target, head, _tree(args), compile=args.compile, speculate=args.speculate)
    seconds = decoder.warmup()
    if seconds:
        logger.info("compiled in %.1f s: %s", sum(seconds.values()), ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    if decoder.auto_report is not None:
        logger.info("auto tree: %s", decoder.auto_report["summary"])
    if head is not None:
        logger.info("speculation: %s (break-even tau %s at batch 1)", args.speculate, decoder.policy.report()["break_even_tau"].get(1))
    return decoder


def cmd_generate(args) -> int:
    _, config = _sampling(args)  # validate before loading anything
    _tree(args)
    target, head = _load(args)
    prompt_ids = target.encode(args.chat if args.chat is not None else args.prompt, chat=args.chat is not None)
    decoder = _decoder(args, target, head)
    if args.stream and not args.json:
        for output in decoder.stream(prompt_ids, config):
            sys.stdout.write(output.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    result = decoder.generate(prompt_ids, config)
    record = {
        "text": result.text,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.token_ids),
        "finish_reason": result.finish_reason,
        "tau": round(result.tau, 4),
        "tokens_per_second": round(result.tokens_per_second, 2),
        "draft_s": round(result.draft_s, 4),
        "verify_s": round(result.verify_s, 4),
        "accepted_per_step": [s.accepted for s in result.steps],
        "drafted_steps": sum(1 for s in result.steps if s.tree_size > 0),
        "policy": decoder.policy.report() if head is not None else None,
    }
    if args.json:
        sys.stdout.write(json.dumps(record) + "\n")
    else:
        sys.stdout.write(result.text + "\n")
        logger.info(
            "%d tokens, %.1f tok/s, tau %.2f, draft %.2fs, verify %.2fs",
            record["completion_tokens"], record["tokens_per_second"], record["tau"], record["draft_s"], record["verify_s"],
        )
    return 0


def cmd_bench(args) -> int:
    from eagle import bench
    from eagle.errors import EagleError

    sampling, _ = _sampling(args)  # validates max_new_tokens and sampling before anything loads
    baselines = [b for b in args.baselines.split(",") if b]
    unknown = set(baselines) - set(bench.HF_BASELINES)  # checked before the target loads
    if unknown:
        raise EagleError(f"unknown baseline(s) {', '.join(sorted(unknown))}: expected {', '.join(bench.HF_BASELINES)}")
    prompts = bench.load_prompts(args.prompts, limit=args.limit) if args.prompt_set is None else None
    _tree(args)  # bad tree settings fail before the target loads
    target, head = _load(args)
    if prompts is None:
        prompts = bench.prompt_set(args.prompt_set, target, args.limit)
    result = bench.run_bench(
        target,
        head,
        prompts,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        tree=_tree(args),
        baselines=baselines,
        chat=not args.no_chat,
        seed=args.seed,
        head_label=args.head,
        compile=args.compile,
        speculate=args.speculate,
    )
    result.setdefault("config", {})["command"] = "eaglectl " + " ".join(sys.argv[1:])
    paths = bench.write_report(result, args.out)
    logger.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    aggregate = result.get("aggregate", {})
    sys.stdout.write(json.dumps(aggregate, indent=2, default=str) + "\n")
    return 0


def cmd_profile(args) -> int:
    from eagle.profile import profile_forward

    sizes = [int(s) for s in args.sizes.split(",") if s]
    draft_vocabs = [int(s) for s in args.draft_vocab.split(",") if s]
    result = profile_forward(
        args.target, dtype=args.dtype, sizes=sizes, context=args.context, repeats=args.repeats, draft_vocabs=draft_vocabs,
        compile=args.compile, device=args.device,
    )
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


def cmd_prompts(args) -> int:
    from eagle import bench
    from eagle.target import load_target

    target = load_target(args.target, dtype=args.dtype, device=args.device)
    prompts = bench.prompt_set(args.prompt_set, target, args.limit)
    path = bench.write_prompts(prompts, args.out)
    logger.info("wrote %d prompts (%s) to %s", len(prompts), args.prompt_set, path)
    return 0


def cmd_head(args) -> int:
    from eagle.formats import export_head

    path = export_head(resolve_head_spec(args.source), args.dest, args.fmt, verifier=args.verifier)
    sys.stdout.write(f"{path}\n")
    return 0


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "prompts": cmd_prompts, "profile": cmd_profile, "head": cmd_head}


COMMANDS_GROUP = "eagle.commands"  # more eaglectl commands from other packages (eagle-platform: targets, platform)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    from importlib.metadata import entry_points

    plugins = {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}
    if argv and argv[0] in plugins:
        return plugins[argv[0]].load()(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("transformers", "DeepSpeed", "urllib3", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if getattr(args, "threads", None):
        from eagle.runtime import use_threads

        use_threads(args.threads)
    from eagle.errors import EagleError

    try:
        return COMMANDS[args.command](args)
    except EagleError as err:
        sys.stderr.write(f"eaglectl {args.command}: error: {err}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
