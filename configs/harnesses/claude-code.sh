#!/usr/bin/env bash
# Claude Code (npm @anthropic-ai/claude-code, unmodified, installed by `make harnesses`) as one
# tidal execution: the command agent kind sets OPENAI_BASE_URL (the execution's own proxy URL,
# .../x/<execution>/v1) and OPENAI_API_KEY (its own tx- key); Claude Code takes the same URL
# without /v1 (its SDK adds /v1/messages) and sends the key as a bearer token. Offline: no
# telemetry, no update checks, no thinking (tidal refuses thinking budgets), its config in the
# execution's workspace. Arguments: the task prompt, then any further claude flags.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
claude="${TIDAL_HARNESSES:-$root/harnesses}/node_modules/.bin/claude"
[ -x "$claude" ] || { echo "no $claude: run 'make harnesses' first" >&2; exit 127; }
export ANTHROPIC_BASE_URL="${OPENAI_BASE_URL%/v1}"
export ANTHROPIC_AUTH_TOKEN="$OPENAI_API_KEY"
unset ANTHROPIC_API_KEY
export ANTHROPIC_SMALL_FAST_MODEL="$OPENAI_MODEL" ANTHROPIC_DEFAULT_HAIKU_MODEL="$OPENAI_MODEL"
export CLAUDE_CONFIG_DIR="$PWD/.tidal/claude"  # the command kind runs it in the workspace
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1
export CLAUDE_CODE_DISABLE_THINKING=1 CLAUDE_CODE_EFFORT_LEVEL=unset
prompt="$1"
shift
exec "$claude" -p "$prompt" --model "$OPENAI_MODEL" "$@"
