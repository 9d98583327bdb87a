"""python -m client "prompt" [--stream] [--max-new-tokens N] [sampling flags] [--url URL]

Prints the answer (tokens as they arrive with --stream). Exit status 1 with the server's message
on an error. The API key comes from --api-key or $LLM_SERVING_API_KEY.
"""

import argparse
import os
import sys

import httpx
from pydantic import ValidationError

from agent.contract.sampling import add_sampling_options, sampling_options
from client.native import DEFAULT_URL, Client, ServerError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m client", description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", default="default", help="served model name (default: default)")
    p.add_argument("--api-key", default=os.environ.get("LLM_SERVING_API_KEY"))
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--protocol", choices=["sse", "plain"], default="sse", help="stream format")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_options(p, top_k=3)  # the native API's default
    args = p.parse_args(argv)
    params = dict(
        max_new_tokens=args.max_new_tokens, chat_template=args.chat or None, **sampling_options(args)
    )
    client = Client(args.url, args.model, args.api_key)
    try:
        if args.stream:
            for piece in client.generate_stream(args.prompt, args.protocol, **params):
                print(piece, end="", flush=True)
            print()
        else:
            print(client.generate(args.prompt, **params))
    except ValidationError as exc:
        print(
            f"error: bad parameter: {exc.errors()[0]['loc'][-1]}: {exc.errors()[0]['msg']}", file=sys.stderr
        )
        return 2
    except ServerError as exc:
        print(f"\nerror: the server answered {exc}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
