#!/usr/bin/env bash
# Codex CLI (npm @openai/codex, unmodified, installed by `make harnesses`) as one tidal
# execution: a model provider in the execution's own CODEX_HOME points at its proxy URL
# (OPENAI_BASE_URL, .../x/<execution>/v1, set by the command agent kind) with its own key
# (OPENAI_API_KEY) over the Responses wire API (Codex ignores OPENAI_BASE_URL alone). Offline: no
# web search, no sub-agents, goals or skills. Codex keeps its own 17 KB instructions unless
# $CODEX_INSTRUCTIONS is set (then that text replaces them: a shorter prompt for a small model).
# The workspace is the execution's own, so Codex runs without its sandbox. Arguments: the task
# prompt.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
codex="${TIDAL_HARNESSES:-$root/harnesses}/node_modules/.bin/codex"
[ -x "$codex" ] || { echo "no $codex: run 'make harnesses' first" >&2; exit 127; }
export CODEX_HOME="$PWD/.tidal/codex"  # the command kind runs it in the workspace
mkdir -p "$CODEX_HOME"
instructions=""
if [ -n "${CODEX_INSTRUCTIONS:-}" ]; then
    printf '%s\n' "$CODEX_INSTRUCTIONS" > "$CODEX_HOME/instructions.md"
    instructions="model_instructions_file = \"$CODEX_HOME/instructions.md\""
fi
cat > "$CODEX_HOME/config.toml" <<TOML
model = "$OPENAI_MODEL"
model_provider = "tidal"
web_search = "disabled"
model_reasoning_summary = "none"
$instructions
include_apps_instructions = false
include_collaboration_mode_instructions = false
check_for_update_on_startup = false
[features]
goals = false
view_image = false
[agents]
enabled = false
[analytics]
enabled = false
[model_providers.tidal]
name = "tidal"
base_url = "$OPENAI_BASE_URL"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
TOML
exec "$codex" exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox "$@"
