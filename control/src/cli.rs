//! The `corral` command line. Every flag also reads a `CORRAL_*` variable.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// A value never shown, not even in a debug line.
#[derive(Clone, Default)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("(hidden)")
    }
}

impl ConnArgs {
    /// What the environment says of a front door: `CORRAL_URL` (its
    /// address, where no worker is named) and `CORRAL_API_KEY` (a key).
    pub fn with_front_door_env(mut self) -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        if self.worker.is_none() {
            self.worker = var("CORRAL_URL");
        }
        self.api_key = var("CORRAL_API_KEY").map(|k| Secret(k.trim().to_string()));
        self
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "corral",
    version,
    about = "Run commands and agents in hardened remote sandboxes"
)]
pub struct Cli {
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Log format: json (one object per line), text, or auto (text on a
    /// terminal, else json).
    #[arg(long, global = true, env = "CORRAL_LOG_FORMAT", value_enum, default_value_t = corral_worker::process::LogFormat::Auto)]
    pub log_format: corral_worker::process::LogFormat,
    /// Serve the control plane's Prometheus metrics (placements, probes,
    /// workers lost) at http://ADDR/metrics while the command runs.
    #[arg(long, global = true, env = "CORRAL_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Args)]
pub struct ConnArgs {
    /// Workers to use: a comma-separated list of addresses
    /// (http://host:port, https://..., unix:///path) and DNS names
    /// (dns:///NAME:PORT, one worker per address). What is new (a session,
    /// `exec`'s sandbox, `sandbox create`) is placed among them; commands
    /// about one sandbox find its worker. Without it, the local worker:
    /// started by the first command that needs it (against the local
    /// Docker engine), shared by the others, gone when idle.
    #[arg(long, global = true, env = "CORRAL_WORKER")]
    pub worker: Option<String>,
    /// How long a worker may stay unreachable before its sandbox is taken
    /// for lost: `exec` then exits 125, a session fails (HTTP/2 keepalive
    /// notices a dead connection within about 30 s).
    #[arg(long, global = true, env = "CORRAL_WORKER_LOST_AFTER", default_value = "60s", value_parser = humantime::parse_duration)]
    pub worker_lost_after: Duration,
    /// Placement asks every worker (up to 8; two of many) how full it is,
    /// and waits for the others' answers at least this long once one
    /// could take the sandbox (or as long again as that first answer
    /// took, if longer); a worker slower than that is left out of this
    /// choice. Raise it for workers far away or hosts under heavy load.
    #[arg(long, global = true, env = "CORRAL_PLACEMENT_GRACE", default_value = "20ms", value_parser = humantime::parse_duration)]
    pub placement_grace: Duration,
    /// File holding the worker's bearer token.
    #[arg(long, global = true, env = "CORRAL_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// A front door's key (`corral admin key create`), from the environment
    /// alone (`CORRAL_API_KEY`; a key on a command line is seen by every
    /// user of the machine): presented instead of a token file.
    #[arg(skip)]
    pub api_key: Option<Secret>,
    /// For an https:// worker: the CA that signed its certificate (default:
    /// the system's roots).
    #[arg(long, global = true, env = "CORRAL_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// The name the workers' certificates must carry when it is not the
    /// address's host (workers reached by IP whose certificates name a
    /// Service); default: the DNS name of --worker, when it is one.
    #[arg(long, global = true, env = "CORRAL_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
    /// Client certificate (PEM) for a worker that requires mutual TLS.
    #[arg(long, global = true, env = "CORRAL_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Key (PEM) of --tls-cert.
    #[arg(long, global = true, env = "CORRAL_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Local worker: Docker engine to use (default: DOCKER_HOST or the local socket).
    #[arg(long, global = true, env = "CORRAL_DOCKER_HOST")]
    pub docker_host: Option<String>,
    /// Local worker: its state directory.
    #[arg(long, global = true, env = "CORRAL_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command in a sandbox; exits with the command's exit code.
    Exec(ExecArgs),
    /// Manage sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// A sandbox's ports reached from outside, through its worker's port
    /// listener (`corral-worker --ports-listen`).
    #[command(subcommand)]
    Port(PortCommand),
    /// Templates: images built on a worker from a Dockerfile, kept by
    /// name with what a sandbox made from one starts with and when it is
    /// ready (`corral sandbox create --template NAME`).
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Volumes: filesystems a worker keeps across sandboxes and restarts,
    /// each of a size its filesystem enforces, mounted at a create
    /// (`corral sandbox create --volume NAME:/data[:ro]`); one writer at a
    /// time, any number of readers.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Serve MCP over stdio: tools that run commands and read and write
    /// files in a sandbox, for an agent that reaches tools over MCP (its
    /// config names `corral mcp` as the server's command). The session's
    /// sandbox is made at the first tool that needs one and removed when
    /// the client goes (unless --keep).
    Mcp(McpArgs),
    /// A sandbox's operations: the running ones (--all: the finished ones
    /// its worker remembers too).
    Ps {
        sandbox: String,
        #[arg(long, short)]
        all: bool,
    },
    /// Cancel a running operation (of --sandbox, else found among the
    /// worker's sandboxes).
    Kill {
        operation: String,
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// What a sandbox's operations printed, as far back as its journal
    /// reaches; with -f, then what they print, live, until Ctrl-C.
    Logs {
        sandbox: String,
        #[arg(long, short)]
        follow: bool,
    },
    /// Copy files and directories into or out of a sandbox:
    /// `corral cp LOCAL SANDBOX:PATH` or `corral cp SANDBOX:PATH LOCAL`.
    /// Into a directory that exists, the source keeps its name; else it
    /// takes the destination's. Modes and times are kept, links are copied
    /// as links.
    Cp(CpArgs),
    /// Run an agent: a model drives tools in a sandbox until the task is done.
    Run(Box<RunArgs>),
    /// Serve the control plane: host many sessions at once for clients
    /// over gRPC (`corral.v1.Control`; `corral run --control` is one),
    /// running them on the workers of --worker. Sessions outlive their
    /// clients and the service's restarts.
    Serve(Box<ServeArgs>),
    /// Inspect and fork agent sessions.
    #[command(subcommand)]
    Session(SessionCommand),
    /// A worker's state, and its drain (for maintenance: no new sandboxes,
    /// the ones it has served until they end or its drain deadline).
    #[command(subcommand)]
    Worker(WorkerCommand),
    /// What an operator does: tenants' keys, and the audit log of
    /// `corral serve`.
    Admin(AdminArgs),
    /// The local worker process (started by `corral` itself when needed).
    #[command(hide = true)]
    LocalWorker {
        /// Exit after no command has been connected for this long.
        #[arg(long, env = "CORRAL_LOCAL_WORKER_IDLE", default_value = "30s", value_parser = humantime::parse_duration)]
        idle: Duration,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum TemplateCommand {
    /// Build NAME from a Dockerfile and its context on a worker that
    /// builds (`corral-worker --allow-build`), the engine's output shown
    /// as it comes. The same inputs build nothing the second time; a name
    /// built again is moved to the new image. Exits 1 naming the step that
    /// failed.
    Build {
        name: String,
        /// The build's context: a directory (default: the current one).
        #[arg(default_value = ".")]
        context: std::path::PathBuf,
        /// The Dockerfile, inside the context (default: CONTEXT/Dockerfile).
        #[arg(short = 'f', long = "file")]
        file: Option<std::path::PathBuf>,
        /// A command (sh -c) started in each sandbox of the template and
        /// left running (its operation: `template-start`).
        #[arg(long)]
        start: Option<String>,
        /// Ready once something accepts connections on this port of the
        /// sandbox's loopback.
        #[arg(long, conflicts_with_all = ["ready_cmd", "ready_http"])]
        ready_port: Option<u16>,
        /// Ready once this command (sh -c) exits 0.
        #[arg(long, conflicts_with = "ready_http")]
        ready_cmd: Option<String>,
        /// Ready once GET http://127.0.0.1:PORT/PATH answers 2xx or 3xx,
        /// given as PORT/PATH (e.g. 8000/health).
        #[arg(long)]
        ready_http: Option<String>,
        /// How long a new sandbox may take to be ready (default 60s, at
        /// most 30m); past it the create fails and the sandbox is removed.
        #[arg(long, value_parser = humantime::parse_duration)]
        ready_timeout: Option<Duration>,
        /// The longest the build may take (default and most: the worker's
        /// --max-build-time).
        #[arg(long, value_parser = humantime::parse_duration)]
        timeout: Option<Duration>,
        /// Show none of the engine's output.
        #[arg(long, short)]
        quiet: bool,
    },
    /// The templates there are: name, image, start command, readiness.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Template NAME as one JSON object: its image, start command,
    /// readiness probe and its time to be ready, when it was built.
    Inspect { name: String },
    /// Forget template NAME. Refused while sandboxes of it run or a pool
    /// keeps members of it, unless --force (they go on).
    Rm {
        name: String,
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum McpCommand {
    /// Print what an MCP client needs to start `corral mcp` (with this
    /// command's worker and token file, absolute): `claude` (a `claude mcp
    /// add` command line), `codex` (a ~/.codex/config.toml table), `cursor`
    /// (.cursor/mcp.json).
    Config {
        #[arg(value_enum)]
        client: McpClient,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum McpClient {
    Claude,
    Codex,
    Cursor,
}

#[derive(Debug, Clone, Args)]
pub struct McpArgs {
    #[command(subcommand)]
    pub command: Option<McpCommand>,
    /// Bind this existing sandbox to the session (kept at its end).
    #[arg(long)]
    pub sandbox: Option<String>,
    /// The image of the sandboxes the session makes (default: the
    /// worker's).
    #[arg(long, env = "CORRAL_IMAGE")]
    pub image: Option<String>,
    /// Keep the sandboxes the session made when it ends.
    #[arg(long)]
    pub keep: bool,
    /// Its sandboxes are removed by their worker after this long with no
    /// call (a server killed outright leaves them no longer); 0: never.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    pub idle_timeout: Duration,
}

#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Make volume NAME (the same name and size again is a no-op).
    Create {
        name: String,
        /// Its size, e.g. 10g (default: the worker's --default-volume-size).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
    },
    /// The volumes there are: name, size, use, writer, readers.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Remove volume NAME and everything in it (refused while a sandbox
    /// mounts it).
    Rm { name: String },
    /// Copy into or out of a volume, through a sandbox of its own:
    /// `corral volume cp LOCAL VOLUME:PATH` or `corral volume cp
    /// VOLUME:PATH LOCAL` (as `corral cp`; a copy in is refused while
    /// another sandbox writes to the volume).
    Cp(CpArgs),
    /// Move volume NAME from the worker of --worker to the worker --to:
    /// made there of the same size, its files streamed across (while no
    /// sandbox may write to it), then removed here. Refused while a
    /// sandbox writes to it, or when --to has a volume of that name.
    Move {
        name: String,
        /// The worker it goes to (an address, as --worker).
        #[arg(long)]
        to: String,
        /// The token file of --to (default: --token-file's).
        #[arg(long, env = "CORRAL_TO_TOKEN_FILE")]
        to_token_file: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum PortCommand {
    /// Expose PORT of sandbox ID; prints its URL (for signed access, with
    /// its token: a browser opens it as it is, and keeps the token as a
    /// cookie). Exposing a port again replaces its exposure.
    Expose {
        id: String,
        port: u16,
        /// Who may use it: private (the worker's token), signed (a token
        /// made for this port and time), or public (anyone; where the
        /// worker allows it).
        #[arg(long, value_enum, default_value_t = PortAccessArg::Private)]
        access: PortAccessArg,
        /// How long it lives (default: until revoked; signed: 1h).
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
        /// A request to the port while the sandbox is checkpointed
        /// restores it (the request's credential checked first).
        #[arg(long)]
        wake_on_request: bool,
        /// One JSON object: url, and token where one is needed.
        #[arg(long)]
        json: bool,
    },
    /// The exposed ports of sandbox ID: port, access, URL, time left.
    Ls {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// End the exposure of PORT: its tokens are refused, its open
    /// connections cut. Exits 1 when it was not exposed.
    Revoke { id: String, port: u16 },
    /// Forward a local TCP port to PORT of sandbox ID, for any TCP
    /// protocol (a database's, SSH): each connection is a tunnel through
    /// the worker's port listener. A port not exposed is exposed (signed)
    /// for as long as this runs, then revoked; a private or public one is
    /// used as it is; a signed one takes its token from CORRAL_PORT_TOKEN
    /// (the environment alone: a command line is seen by every user).
    /// Says `listening on ADDR` first, then runs until interrupted.
    Forward {
        id: String,
        port: u16,
        /// The local address to listen on (default 127.0.0.1:PORT; a port
        /// of 0 takes any free one).
        #[arg(long, value_name = "ADDR")]
        local: Option<std::net::SocketAddr>,
        /// How long the exposure made for this forward lives at most.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "1h")]
        ttl: Duration,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PortAccessArg {
    Private,
    Signed,
    Public,
}

#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// The tenants' directory a front door serves (`corral serve
    /// --tenants DIR`): its keys are made and revoked here, offline; a
    /// running front door sees each change within a second.
    #[arg(long, env = "CORRAL_TENANTS", value_name = "DIR", global = true)]
    pub tenants: Option<PathBuf>,
    /// A running front door (`corral serve --tenants DIR`) whose
    /// directory is changed, with an admin key in CORRAL_API_KEY (where no
    /// --tenants is given).
    #[arg(long, env = "CORRAL_URL", value_name = "URL", global = true)]
    pub url: Option<String>,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum AdminCommand {
    /// The tenants' keys.
    #[command(subcommand)]
    Key(KeyCommand),
    /// The tenants' quotas.
    #[command(subcommand)]
    Quota(QuotaCommand),
    /// The audit log (`corral serve --audit-log FILE`).
    #[command(subcommand)]
    Audit(AuditCommand),
}

#[derive(Debug, Clone, Subcommand)]
pub enum QuotaCommand {
    /// Sets a tenant's quotas: `sandboxes=N` (at once, on all workers),
    /// `memory=SIZE` (e.g. 64g), `cpus=N` and `pids=N` (the sandboxes'
    /// limits summed), `sessions=N` (at once), `creates_per_minute=N`;
    /// `NAME=none` lifts one. A front door applies them within a second.
    Set {
        #[arg(long)]
        tenant: String,
        #[arg(required = true, value_name = "NAME=VALUE")]
        quotas: Vec<String>,
    },
    /// Every tenant's quotas.
    Ls {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum KeyCommand {
    /// Makes a key for a tenant and prints it, this once (only its digest
    /// is kept).
    Create {
        /// The tenant: 1-63 characters of [a-z0-9-].
        #[arg(long)]
        tenant: String,
        /// What it allows: read (list, inspect, logs, timelines), run
        /// (sandboxes and sessions), admin (every tenant). Repeat or
        /// separate with commas.
        #[arg(long = "scope", required = true, value_delimiter = ',')]
        scopes: Vec<String>,
        /// Valid for this long (`30d`, `12h`); default: until revoked.
        #[arg(long, value_parser = humantime::parse_duration)]
        expires: Option<Duration>,
        /// Print `{"key": ..., "id": ..., ...}` instead of the key alone.
        #[arg(long)]
        json: bool,
    },
    /// The keys: id, tenant, scopes, times (never a key).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Revokes a key by its id (`key ls`): a front door refuses it within
    /// a second.
    Revoke { id: String },
}

#[derive(Debug, Clone, Subcommand)]
pub enum AuditCommand {
    /// Checks the log's chain from its first line: exits 0 and says how
    /// many records it holds when whole, 1 naming the first line that was
    /// removed, moved or altered (lines cut from its end are not found).
    Verify {
        /// The audit log.
        file: PathBuf,
    },
}

#[derive(Debug, Clone, Args)]
pub struct CpArgs {
    /// What to copy: a local path, or SANDBOX:PATH (a relative PATH is
    /// under /workspace).
    pub src: String,
    /// Where to: SANDBOX:PATH, or a local path. A local path with a colon
    /// is written ./like:this.
    pub dest: String,
    /// Show no progress, even on a terminal.
    #[arg(long, short, env = "CORRAL_QUIET")]
    pub quiet: bool,
    #[command(flatten)]
    pub out: OutArgs,
}

/// What is taken of files coming out of a sandbox (`cp` out, exports):
/// they are the sandbox's, so hostile.
#[derive(Debug, Clone, Args)]
pub struct OutArgs {
    /// Most bytes of file data one copy out brings (a sparse file counts
    /// at its full size); past it the copy fails.
    #[arg(long, env = "CORRAL_MAX_BYTES", default_value = "8g", value_parser = parse_size)]
    pub max_bytes: u64,
    /// Most entries (files, directories, links) one copy out brings.
    #[arg(long, env = "CORRAL_MAX_ENTRIES", default_value_t = corral_harness::transfer::DEFAULT_MAX_ENTRIES)]
    pub max_entries: u64,
    /// Bring git's configuration, hooks and info/attributes too (left out
    /// by default: a repository's config can name commands that git runs
    /// on this machine).
    #[arg(long, env = "CORRAL_WITH_GIT_CONFIG")]
    pub with_git_config: bool,
}

impl OutArgs {
    /// These limits over `rules`.
    pub fn apply(
        &self,
        mut rules: corral_harness::transfer::Unpacking,
    ) -> corral_harness::transfer::Unpacking {
        rules.max_bytes = Some(self.max_bytes);
        rules.max_entries = Some(self.max_entries);
        rules.skip_git_config = !self.with_git_config;
        rules
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ApiKind {
    /// OpenAI Responses API (`POST {base}/responses`).
    Responses,
    /// Chat Completions (`POST {base}/chat/completions`): vLLM, Ollama,
    /// llama.cpp's server, OpenRouter...
    Chat,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// The task. With an existing --session, a new input (or nothing, to resume).
    pub prompt: Option<String>,
    /// A JSON request (prompt or messages, system_prompt, model, tools,
    /// limits) from a file, or `-` for stdin. Unknown fields are rejected.
    #[arg(long, env = "CORRAL_REQUEST", value_name = "FILE|-")]
    pub request: Option<String>,
    /// Model name (default: the request's, else gpt-5-mini).
    #[arg(long, env = "CORRAL_MODEL")]
    pub model: Option<String>,
    /// Model endpoint (default: the session's, else https://api.openai.com/v1).
    #[arg(long, env = "CORRAL_BASE_URL")]
    pub base_url: Option<String>,
    /// Wire protocol of the endpoint (default: the session's, else responses).
    #[arg(long, env = "CORRAL_API", value_enum)]
    pub api: Option<ApiKind>,
    /// Whether the model must call a tool: auto, required, none, or a
    /// tool's name (default: the request's, else the provider's). A forced
    /// choice is `auto` once the model has made such a call, until the next
    /// user message (as the OpenAI Agents SDK resets it), unless
    /// --keep-tool-choice.
    #[arg(long, env = "CORRAL_TOOL_CHOICE")]
    pub tool_choice: Option<String>,
    /// Keeps a forced --tool-choice on every request, even after the tool
    /// was called (the model can then never answer in text: the run goes
    /// on to --max-turns).
    #[arg(long, env = "CORRAL_KEEP_TOOL_CHOICE")]
    pub keep_tool_choice: bool,
    /// The model's context window, in tokens (default: the request's
    /// `limits.context_window_tokens`, else 200,000). Give a local server's
    /// (llama.cpp's `--ctx-size`) so requests fit it.
    #[arg(long, env = "CORRAL_CONTEXT_WINDOW", value_name = "TOKENS", value_parser = clap::value_parser!(u64).range(1024..))]
    pub context_window: Option<u64>,
    /// Most tokens one answer may take (default: the request's
    /// `limits.max_output_tokens`, else the provider's); what the context
    /// keeps free for it, up to a quarter of the window.
    #[arg(long, env = "CORRAL_MAX_OUTPUT_TOKENS", value_name = "TOKENS", value_parser = clap::value_parser!(u32).range(16..))]
    pub max_output_tokens: Option<u32>,
    /// File holding the API key (default: the OPENAI_API_KEY variable).
    #[arg(long, env = "CORRAL_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Image of the session's sandbox (new sessions only; default:
    /// corral-debian:latest, with python3, git and a C toolchain; build it
    /// with deploy/images/build-debian.sh).
    #[arg(long, env = "CORRAL_IMAGE")]
    pub image: Option<String>,
    /// A template of the worker's for the session's sandbox (new sessions
    /// only; `corral template build`): its image, its start command, ready
    /// before the run begins.
    #[arg(long, env = "CORRAL_TEMPLATE")]
    pub template: Option<String>,
    /// Session id: a new one is created, an existing one resumed.
    #[arg(long, env = "CORRAL_SESSION")]
    pub session: Option<String>,
    /// Where sessions are kept (default: $XDG_STATE_HOME/corral/sessions;
    /// with --control, the service's).
    #[arg(long, env = "CORRAL_SESSIONS_DIR")]
    pub sessions_dir: Option<PathBuf>,
    /// Tell the model what is still running after this long without a turn
    /// (e.g. 10m, 30s; 0 disables). Default 10m (with --control, the
    /// service's).
    #[arg(long, env = "CORRAL_HEARTBEAT", value_parser = parse_heartbeat)]
    pub heartbeat: Option<Duration>,
    /// Most model requests in one run.
    #[arg(long, env = "CORRAL_MAX_TURNS")]
    pub max_turns: Option<u64>,
    /// A folder of skills (`NAME/SKILL.md` with YAML front matter, and any
    /// files beside it): copied into the sandbox and offered through the
    /// SkillUse tool (new sessions only).
    #[arg(long, env = "CORRAL_SKILLS_DIR")]
    pub skills: Option<PathBuf>,
    /// A local directory whose contents the session's /workspace starts
    /// with (new sessions only; copied once, before the first turn).
    #[arg(long, env = "CORRAL_WORKSPACE", value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// When the run ends, copy the session's /workspace into this local
    /// directory (made if missing).
    #[arg(long, env = "CORRAL_EXPORT", value_name = "DIR")]
    pub export: Option<PathBuf>,
    #[command(flatten)]
    pub out: OutArgs,
    /// Leave the session's sandbox running when the run ends. By default
    /// it is suspended: its /workspace is saved beside the session's log
    /// and the sandbox removed, so it holds nothing on the worker; the next
    /// run brings the files back (not the processes).
    #[arg(long, env = "CORRAL_KEEP_SANDBOX")]
    pub keep_sandbox: bool,
    /// What a new session's runs do when its sandbox is lost (its worker
    /// unreachable past --worker-lost-after): fail, or go on in a fresh
    /// sandbox placed anew, the model told what was lost (over the
    /// request's `on_sandbox_lost`).
    #[arg(long, env = "CORRAL_ON_SANDBOX_LOST", value_enum)]
    pub on_sandbox_lost: Option<LostPolicy>,
    /// Export traces (OpenTelemetry, OTLP over gRPC, GenAI conventions) to
    /// this collector, e.g. http://127.0.0.1:4317: a trace per session run,
    /// joined with the worker's operation spans. Off by default.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// Reasoning effort for models that take one (Responses API): low,
    /// medium or high (new sessions only).
    #[arg(long, env = "CORRAL_REASONING_EFFORT", value_parser = ["low", "medium", "high"])]
    pub reasoning_effort: Option<String>,
    /// System prompt (after Corral's preamble).
    #[arg(long, env = "CORRAL_SYSTEM_PROMPT")]
    pub system_prompt: Option<String>,
    /// While the run goes on, read further inputs from stdin, one per line:
    /// each one steers (a request in flight is canceled and asked again
    /// with it). End of input just stops reading.
    #[arg(long, env = "CORRAL_INPUTS_FROM_STDIN")]
    pub inputs_from_stdin: bool,
    /// One JSON event per line on stdout (also the default when stdout is
    /// not a terminal).
    #[arg(long, env = "CORRAL_JSON")]
    pub json: bool,
    /// How long completions of one turn's calls are batched (e.g. 1s;
    /// default 1s, with --control the service's).
    #[arg(long, env = "CORRAL_GRACE", value_parser = humantime::parse_duration, hide = true)]
    pub grace: Option<Duration>,
    /// Run the session on the control plane service at this address
    /// (`corral serve`; http://HOST:PORT or https://...), shown here as a
    /// local run is. The service's workers and sessions directory apply.
    #[arg(long, env = "CORRAL_CONTROL", value_name = "URL")]
    pub control: Option<String>,
    /// File holding the service's bearer token.
    #[arg(long, env = "CORRAL_CONTROL_TOKEN_FILE", requires = "control")]
    pub control_token_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to serve on.
    #[arg(long, env = "CORRAL_SERVE_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: std::net::SocketAddr,
    /// The service's own state: its token (unless --serve-token-file) and
    /// the marks of the sessions it hosts (default:
    /// $XDG_STATE_HOME/corral/control).
    #[arg(long, env = "CORRAL_SERVE_STATE_DIR")]
    pub serve_state_dir: Option<PathBuf>,
    /// File holding the bearer token clients must present (at least 16
    /// characters, readable by its owner only). Default: `token` in the
    /// state directory, made on first start.
    #[arg(long, env = "CORRAL_SERVE_TOKEN_FILE")]
    pub serve_token_file: Option<PathBuf>,
    /// Serve TLS with this certificate (PEM).
    #[arg(long, env = "CORRAL_SERVE_TLS_CERT", requires = "serve_tls_key")]
    pub serve_tls_cert: Option<PathBuf>,
    /// Key (PEM) of --serve-tls-cert.
    #[arg(long, env = "CORRAL_SERVE_TLS_KEY", requires = "serve_tls_cert")]
    pub serve_tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (mutual TLS).
    #[arg(long, env = "CORRAL_SERVE_TLS_CLIENT_CA", requires = "serve_tls_cert")]
    pub serve_tls_client_ca: Option<PathBuf>,
    /// Most sessions hosted at once; a start past it is refused
    /// (RESOURCE_EXHAUSTED, reason at_capacity).
    #[arg(long, env = "CORRAL_MAX_SESSIONS", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_sessions: u64,
    /// Write one JSON line for each call that changes a session or a
    /// sandbox or reads its data (who, the call, the session or sandbox,
    /// the outcome; never its text, an environment value or a key),
    /// hash-chained so that `corral admin audit verify FILE` finds a line
    /// removed, moved or altered; appended to FILE (`-`: stdout).
    #[arg(long, env = "CORRAL_AUDIT_LOG", value_name = "FILE")]
    pub audit_log: Option<PathBuf>,
    /// Serve tenants: callers present keys of this directory (`corral
    /// admin --tenants DIR key create`), not the service's token; each
    /// sees and reaches its tenant's sandboxes alone. Changes to the
    /// directory take effect within a second.
    #[arg(long, env = "CORRAL_TENANTS", value_name = "DIR")]
    pub tenants: Option<PathBuf>,
    /// Every replica of this front door (comma-separated URLs, this one's
    /// among them): a tenant's creates are checked against its quotas by
    /// one replica, its home (chosen from the tenant's name), where its
    /// sessions live too; the others pass such calls there, so quotas hold
    /// over all of them and each answers alike.
    #[arg(
        long,
        env = "CORRAL_PEERS",
        value_delimiter = ',',
        requires = "advertise"
    )]
    pub peers: Vec<String>,
    /// This replica's URL as it appears in --peers.
    #[arg(long, env = "CORRAL_ADVERTISE", value_name = "URL")]
    pub advertise: Option<String>,
    /// Serve sandboxes' exposed ports on this address too (`/p/{sandbox}/
    /// {port}/...`, and `CONNECT {sandbox}:{port}` tunnels): a request a
    /// key of this front door admits reaches its tenant's sandboxes, others
    /// go to the workers as they came (signed URLs, public ports). The URLs
    /// of exposed ports then name it.
    #[arg(long, env = "CORRAL_SERVE_PORTS_LISTEN", value_name = "ADDR")]
    pub ports_listen: Option<std::net::SocketAddr>,
    /// The URL clients reach that listener at (behind a load balancer or
    /// TLS, say); default: http:// and the address it listens on.
    #[arg(
        long,
        env = "CORRAL_SERVE_PORTS_URL",
        value_name = "URL",
        requires = "ports_listen"
    )]
    pub ports_url: Option<String>,
    /// Where sessions are kept (default: $XDG_STATE_HOME/corral/sessions).
    #[arg(long, env = "CORRAL_SESSIONS_DIR")]
    pub sessions_dir: Option<PathBuf>,
    /// Model name of sessions whose request names none.
    #[arg(long, env = "CORRAL_MODEL")]
    pub model: Option<String>,
    /// Model endpoint of sessions whose start names none.
    #[arg(long, env = "CORRAL_BASE_URL")]
    pub base_url: Option<String>,
    /// Another model endpoint clients may name (repeatable):
    /// SCHEME://HOST[:PORT][/PATH] (no port: any; the path a prefix), or
    /// `*` for any. None by default: sessions use the service's endpoint,
    /// and a start naming another is refused (PERMISSION_DENIED, reason
    /// policy_denied, flag --allow-base-url): the service makes requests
    /// to what its clients name.
    #[arg(
        long = "allow-base-url",
        env = "CORRAL_ALLOW_BASE_URL",
        value_delimiter = ',',
        value_name = "URL"
    )]
    pub allow_base_url: Vec<corral_harness::host::EndpointRule>,
    /// Wire protocol of that endpoint.
    #[arg(long, env = "CORRAL_API", value_enum)]
    pub api: Option<ApiKind>,
    /// File holding the API key of sessions whose start gives none
    /// (default: the OPENAI_API_KEY variable).
    #[arg(long, env = "CORRAL_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Image of new sessions' sandboxes whose start names none.
    #[arg(long, env = "CORRAL_IMAGE")]
    pub image: Option<String>,
    /// Heartbeat of sessions whose start says none (0 disables).
    #[arg(long, env = "CORRAL_HEARTBEAT", default_value = "10m", value_parser = parse_heartbeat)]
    pub heartbeat: Duration,
    /// What new sessions do when their sandbox is lost, unless their start
    /// or request says.
    #[arg(long, env = "CORRAL_ON_SANDBOX_LOST", value_enum)]
    pub on_sandbox_lost: Option<LostPolicy>,
    /// Export traces (OpenTelemetry, OTLP over gRPC, GenAI conventions) to
    /// this collector, e.g. http://127.0.0.1:4317: a trace per session run,
    /// joined with the worker's operation spans. Off by default.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    #[arg(long, env = "CORRAL_GRACE", default_value = "1s", value_parser = humantime::parse_duration, hide = true)]
    pub grace: Duration,
    /// Every error status carries one fixed text instead of its own: for
    /// tests that show clients decide by the status's reason alone.
    #[arg(long, env = "CORRAL_WITHHOLD_ERROR_TEXT", hide = true)]
    pub withhold_error_text: bool,
}

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// List sessions.
    Ls {
        #[arg(long, env = "CORRAL_SESSIONS_DIR")]
        sessions_dir: Option<PathBuf>,
    },
    /// Show a session's records.
    Show {
        id: String,
        #[arg(long, env = "CORRAL_SESSIONS_DIR")]
        sessions_dir: Option<PathBuf>,
        /// The raw records, one JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Show a session on a time axis: its model requests, each tool call
    /// (queued, running, placeholder shown, late result, exit status) in
    /// lanes of calls that overlap, inputs, heartbeats, steering, stops,
    /// the fork point, suspended gaps, replaced sandboxes and blocked
    /// egress; then every step with its detail. From its log alone.
    Timeline {
        id: String,
        #[arg(long, env = "CORRAL_SESSIONS_DIR")]
        sessions_dir: Option<PathBuf>,
        /// The same data as JSON.
        #[arg(long, conflicts_with = "html")]
        json: bool,
        /// Write one self-contained HTML page of the timeline here (it
        /// fetches nothing; click a step for its detail).
        #[arg(long, value_name = "FILE")]
        html: Option<PathBuf>,
        /// Columns of the terminal view (default: the terminal's, else 120).
        #[arg(long, value_parser = clap::value_parser!(u16).range(40..))]
        width: Option<u16>,
    },
    /// Copy a session up to a turn into a new one (with a sandbox of its own).
    Fork {
        id: String,
        new_id: String,
        /// Keep turns 1..=N and what happened before turn N+1 (default: all).
        #[arg(long)]
        turn: Option<u64>,
        #[arg(long, env = "CORRAL_SESSIONS_DIR")]
        sessions_dir: Option<PathBuf>,
        /// Export a trace of the fork (OpenTelemetry, OTLP over gRPC) to
        /// this collector.
        #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
        otlp_endpoint: Option<String>,
    },
    /// Copy a session's /workspace into a local directory (made if
    /// missing), from the worker it was placed on; or, with --atif, write
    /// the session as a trajectory.
    Export {
        id: String,
        /// A directory, or with --diff the patch file, or with --atif the
        /// trajectory's file (`-`: stdout).
        dest: PathBuf,
        /// Only the changes, as a patch for `git apply` (the workspace must
        /// be a git repository): against its HEAD, new files included.
        #[arg(long, conflicts_with = "atif")]
        diff: bool,
        /// The session as a trajectory in ATIF (Harbor's Agent Trajectory
        /// Interchange Format), from its log alone: no worker is asked.
        #[arg(long)]
        atif: bool,
        #[command(flatten)]
        out: OutArgs,
        #[arg(long, env = "CORRAL_SESSIONS_DIR")]
        sessions_dir: Option<PathBuf>,
    },
    /// Delete a session and its sandbox (on the worker it was placed on).
    Rm {
        id: String,
        /// Leave the sandbox running.
        #[arg(long)]
        keep_sandbox: bool,
        #[arg(long, env = "CORRAL_SESSIONS_DIR")]
        sessions_dir: Option<PathBuf>,
    },
}

/// Durations like `10m` or `30s`; `0` disables; negative values are refused.
pub fn parse_heartbeat(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!(
            "{s:?}: the heartbeat cannot be negative (0 disables it)"
        ));
    }
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(t).map_err(|e| format!("{s:?}: {e} (use e.g. 10m, 30s, or 0)"))
}

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Run in this existing sandbox (default: a new one, removed afterwards).
    #[arg(long, env = "CORRAL_SANDBOX", conflicts_with = "image")]
    pub sandbox: Option<String>,
    /// Image of the new sandbox.
    #[arg(long, env = "CORRAL_IMAGE")]
    pub image: Option<String>,
    /// Kill the command after this long (e.g. 30s, 5m); exit code 124. By
    /// default (and with 0) none: the command runs until it ends, up to the
    /// worker's cap of 24 h on any one operation.
    #[arg(long, env = "CORRAL_TIMEOUT", value_parser = humantime::parse_duration)]
    pub timeout: Option<Duration>,
    /// Environment variable for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Working directory (default: the workspace).
    #[arg(long, short = 'w', env = "CORRAL_WORKDIR")]
    pub workdir: Option<String>,
    /// Run the command with bash instead of /bin/sh.
    #[arg(long, env = "CORRAL_BASH")]
    pub bash: bool,
    /// Keep stdin open: what this process reads is the command's stdin
    /// (closed at end of input).
    #[arg(long, short = 'i', env = "CORRAL_INTERACTIVE")]
    pub interactive: bool,
    /// Give the command a pseudo-terminal (its size follows this terminal's).
    #[arg(long, short = 't', env = "CORRAL_TTY")]
    pub tty: bool,
    /// Leave what the command started in the background running after it
    /// exits (by default the rest of its process group is killed).
    #[arg(long, env = "CORRAL_KEEP_BACKGROUND")]
    pub keep_background: bool,
    /// A sandbox made for this command is removed by its worker once no
    /// client has used it for this long (when this process was killed).
    #[arg(long, env = "CORRAL_IDLE_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration, conflicts_with = "sandbox")]
    pub idle_timeout: Duration,
    /// Egress rule of the new sandbox (repeatable; see `sandbox create
    /// --egress`).
    #[arg(long = "egress", value_name = "RULE", conflicts_with = "sandbox")]
    pub egress: Vec<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub argv: Vec<String>,
}

impl ExecArgs {
    pub fn env_map(&self) -> BTreeMap<String, String> {
        self.env.iter().cloned().collect()
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Network {
    None,
    Bridge,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum LostPolicy {
    Fail,
    NewSandbox,
}

#[derive(Debug, Subcommand)]
pub enum WorkerCommand {
    /// What the worker of --worker says of itself: id, version, capacity,
    /// sandboxes, drain.
    Info {
        #[arg(long)]
        json: bool,
    },
    /// Start draining the worker of --worker (it survives restarts).
    Drain,
    /// End its drain: it takes new sandboxes again.
    Undrain,
}

#[derive(Debug, Subcommand)]
// Parsed once per process: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum SandboxCommand {
    /// Create a sandbox and print its id.
    Create {
        /// Id to use (default: a random one). Creating the same id and spec twice is a no-op.
        #[arg(long)]
        id: Option<String>,
        #[arg(long, env = "CORRAL_IMAGE")]
        image: Option<String>,
        /// A template of the worker's (`corral template build`): its image,
        /// its start command started and its readiness waited for.
        #[arg(long)]
        template: Option<String>,
        #[arg(long, value_enum, default_value = "none")]
        network: Network,
        /// Working memory, e.g. 512m, 2g. The container's limit adds the
        /// sizes of /workspace and /tmp, whose files live in memory (a full
        /// workspace then fails a write and kills nothing), unless
        /// --memory-includes-files.
        #[arg(long, value_parser = parse_size)]
        memory: Option<u64>,
        /// One limit for processes and files, as `docker run --memory`:
        /// processes may allocate at most --memory, less what the files of
        /// /workspace and /tmp take.
        #[arg(long)]
        memory_includes_files: bool,
        /// CPU limit, e.g. 0.5, 2.
        #[arg(long)]
        cpus: Option<f64>,
        /// Process limit.
        #[arg(long)]
        pids: Option<u32>,
        /// Size of the writable /workspace, e.g. 4g.
        #[arg(long, value_parser = parse_size)]
        workspace_size: Option<u64>,
        /// Size of /tmp, e.g. 512m.
        #[arg(long, value_parser = parse_size)]
        tmp_size: Option<u64>,
        /// Run operations as root instead of the sandbox user (uid 1000).
        #[arg(long)]
        root: bool,
        /// Make the root filesystem writable.
        #[arg(long)]
        writable_rootfs: bool,
        /// Add a Linux capability back (repeatable), e.g. CAP_CHOWN.
        #[arg(long = "cap-add", value_name = "CAP")]
        cap_add: Vec<String>,
        /// Environment variable for every command of the sandbox (repeatable).
        #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_env)]
        env: Vec<(String, String)>,
        /// A label, kept with the sandbox and shown by `sandbox ls --json`
        /// and `inspect` (repeatable); never given to its commands.
        #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_env)]
        label: Vec<(String, String)>,
        /// A volume mounted into it, NAME:/PATH or NAME:/PATH:ro
        /// (repeatable; `corral volume create NAME` first).
        #[arg(long = "volume", short = 'v', value_name = "NAME:/PATH[:ro]", value_parser = parse_volume)]
        volume: Vec<corral_proto::volume::VolumeMount>,
        /// OCI runtime, e.g. runsc for gVisor (as the worker allows).
        #[arg(long)]
        runtime: Option<String>,
        /// Remove the sandbox once no client has used it for this long
        /// (e.g. 30m; default: never).
        #[arg(long, value_parser = humantime::parse_duration)]
        idle_timeout: Option<Duration>,
        /// Remove the sandbox this long after it is made, whatever it does
        /// (e.g. 8h; the worker's --max-lifetime caps it).
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
        /// Egress by policy (repeatable): the sandbox keeps network none
        /// and reaches these destinations only, through its worker's proxy
        /// (HTTP_PROXY): DOMAIN[:PORT], *.DOMAIN[:PORT], CIDR[:PORT]; no
        /// port means 80 and 443. Within the worker's --allow-egress.
        #[arg(long = "egress", value_name = "RULE", conflicts_with = "network")]
        egress: Vec<String>,
        /// The egress proxy even with no --egress: the sandbox reaches
        /// nothing until `corral sandbox egress` gives it a policy.
        #[arg(long, conflicts_with = "network")]
        egress_proxy: bool,
    },
    /// Replace a sandbox's egress policy (one made with --egress or
    /// --egress-proxy): new
    /// connections follow it at once, open ones it no longer allows are
    /// closed. No rule: nothing is allowed.
    Egress {
        id: String,
        /// The whole new policy.
        rules: Vec<String>,
    },
    /// Checkpoint a gVisor sandbox (runtime runsc): its processes and
    /// memory are saved on its worker's engine and it stops, holding no
    /// slot, until `sandbox restore`. The engine needs its experimental
    /// features on.
    Checkpoint { id: String },
    /// Save a running sandbox as template NAME: its image and its
    /// /workspace, not its processes, its /tmp nor what it changed of a
    /// writable root. Each sandbox of NAME starts with that workspace, and
    /// with the start command and readiness of the template it was made
    /// from, if any.
    Snapshot { id: String, name: String },
    /// Start a checkpointed sandbox again: its processes go on where they
    /// stood, its memory as it was.
    Restore { id: String },
    /// Fork a running sandbox: new sandboxes with its limits, policy and
    /// a copy of its /workspace and /tmp as they were at one instant (the
    /// parent frozen only for the first copy; its commands go on). Prints
    /// the children's ids, one a line. runc sandboxes only.
    Fork {
        id: String,
        /// How many children (1 to 100).
        #[arg(long, short = 'n', default_value_t = 1)]
        count: u32,
        /// The children's ids (repeatable; default: random ones).
        #[arg(long = "child-id", value_name = "ID")]
        child_ids: Vec<String>,
        /// One JSON object: the children, the time the parent was frozen
        /// and what was copied.
        #[arg(long)]
        json: bool,
    },
    /// List sandboxes: id, state, image, age, idle time, running
    /// commands, worker and container.
    Ls {
        /// One JSON array of sandboxes.
        #[arg(long)]
        json: bool,
        /// Ids only, one per line.
        #[arg(long, short, conflicts_with = "json")]
        quiet: bool,
        /// Only sandboxes with this label (repeatable: all of them).
        #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_env)]
        label: Vec<(String, String)>,
    },
    /// Everything about one sandbox: spec, limits, image, worker,
    /// container, age, idle time.
    Inspect {
        id: String,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// What sandboxes use now, from their cgroups: memory (tmpfs files
    /// included), CPU over the last second, processes. All of them when no
    /// id is given.
    Stats {
        ids: Vec<String>,
        /// One JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Remove sandboxes (and everything in them).
    Rm {
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        ids: Vec<String>,
        /// Every sandbox of the worker.
        #[arg(long)]
        all: bool,
    },
    /// Remove the sandboxes nobody uses: lost ones, and those running
    /// nothing that no client has used for --idle. Prints what it removed.
    Prune {
        /// How long unused (e.g. 30m, 2h).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        idle: Duration,
    },
    /// Kill every process in a sandbox (its files stay); running commands
    /// end as canceled. Works when the sandbox is at its process limit.
    Reset { id: String },
}

fn parse_volume(s: &str) -> Result<corral_proto::volume::VolumeMount, String> {
    corral_proto::volume::VolumeMount::parse(s).map_err(|e| e.to_string())
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not K=V")),
    }
}

pub use corral_proto::units::parse_size;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats() {
        assert_eq!(parse_heartbeat("0"), Ok(Duration::ZERO));
        assert_eq!(parse_heartbeat("10m"), Ok(Duration::from_secs(600)));
        assert!(parse_heartbeat("-5m").unwrap_err().contains("negative"));
        assert!(parse_heartbeat("soon").is_err());
        let cli = Cli::try_parse_from(["corral", "run", "--heartbeat", "-1s", "x"]);
        assert!(cli.is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn exec_takes_everything_after_the_dashes() {
        let cli = Cli::parse_from(["corral", "exec", "-e", "A=1", "--", "ls", "-la"]);
        let Command::Exec(e) = cli.command else {
            panic!()
        };
        assert_eq!(e.argv, vec!["ls", "-la"]);
        assert_eq!(e.env, vec![("A".into(), "1".into())]);
    }
}
