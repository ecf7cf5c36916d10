#!/usr/bin/env sh
# Writes the compose deployment's secrets, one file each, into $LLMWATCH_SECRETS_DIR
# (default: compose/secrets, ignored by git and by the image build):
#   ingest_token    the trainers' agents          (collector --ingest-token-file)
#   read_token      the dashboard and Prometheus  (collector --read-token-file)
#   control_token   whoever issues commands       (collector --control-token-file)
#   webhook_secret  the HMAC key of signed webhooks (collector --webhook-secret-file)
# Each comes from the environment variable of its name in capitals with an LLMWATCH_
# prefix when set (LLMWATCH_INGEST_TOKEN, ..., LLMWATCH_WEBHOOK_SECRET), else is
# generated; an existing file is kept (a restarted collector keeps its agents' tokens).
#
# Modes: the directory is 0700, so no other user of this host reads a file in it. The
# files are 0644 because compose bind-mounts a secret file into /run/secrets/ as it is,
# and the containers read it as other users (llmwatch 10001, Prometheus and Alertmanager
# nobody 65534); inside a container the file is reached through /run/secrets, not
# through this directory. The collector logs that the files are readable by others: in
# this layout that is expected.
set -eu
dir=${LLMWATCH_SECRETS_DIR:-$(dirname "$0")/secrets}
mkdir -p "$dir"
chmod 700 "$dir"

random_secret() {
    if command -v openssl >/dev/null 2>&1; then
        openssl rand -hex 24
    else
        python3 -c 'import secrets; print(secrets.token_hex(24))'
    fi
}

for name in ingest_token read_token control_token webhook_secret; do
    path="$dir/$name"
    var=LLMWATCH_$(printf '%s' "$name" | tr '[:lower:]' '[:upper:]')
    eval "given=\${$var:-}"
    if [ -n "$given" ]; then
        (umask 077; printf '%s\n' "$given" > "$path")
        echo "make-secrets: $path from \$$var"
    elif [ -s "$path" ]; then
        echo "make-secrets: $path kept"
    else
        (umask 077; random_secret > "$path")
        echo "make-secrets: $path generated"
    fi
    chmod 644 "$path"
done
