//! `corral-worker`'s command line. Every flag also reads a `CORRAL_*`
//! environment variable.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Parser;

use crate::docker::Defaults;
use crate::worker::WorkerConfig;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "corral-worker",
    version,
    about = "Runs Corral operations in hardened Docker sandboxes, served over gRPC"
)]
pub struct WorkerArgs {
    /// Address to serve gRPC on. A token is required unless it is loopback.
    #[arg(long, env = "CORRAL_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// File holding the bearer token clients must present.
    #[arg(long, env = "CORRAL_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Docker engine to use (unix:///var/run/docker.sock, tcp://host:2375);
    /// default: DOCKER_HOST or the local socket.
    #[arg(long, env = "CORRAL_DOCKER_HOST")]
    pub docker_host: Option<String>,
    /// Most sandboxes this worker runs at once.
    #[arg(long, env = "CORRAL_MAX_SANDBOXES", default_value_t = 64)]
    pub max_sandboxes: u32,
    /// Where the worker keeps its id and sandbox records.
    #[arg(long, env = "CORRAL_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// This worker's id (labels its containers); default: stored in the state dir.
    #[arg(long, env = "CORRAL_WORKER_ID")]
    pub worker_id: Option<String>,
    /// The static corral-init binary; default: next to this executable or in
    /// the Cargo target directory.
    #[arg(long, env = "CORRAL_INIT_BINARY")]
    pub init_binary: Option<PathBuf>,
    /// Serve TLS with this certificate (PEM; a chain is fine).
    #[arg(long, env = "CORRAL_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Key of --tls-cert (PEM).
    #[arg(long, env = "CORRAL_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (mutual TLS).
    #[arg(long, env = "CORRAL_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// How often to remove containers of this worker that have no record.
    #[arg(long, env = "CORRAL_SWEEP_INTERVAL", default_value = "60s", value_parser = humantime::parse_duration)]
    pub sweep_interval: std::time::Duration,
    /// Image for sandboxes that name none.
    #[arg(
        long,
        env = "CORRAL_DEFAULT_IMAGE",
        default_value = "corral-sandbox:latest"
    )]
    pub default_image: String,
}

/// Logs to stderr, filtered by `CORRAL_LOG` (default `default_level`), in
/// colour only on a terminal.
pub fn init_logging(default_level: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CORRAL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Parses the command line. Help and version print as usual; a usage error
/// becomes one line (`NAME: what is wrong (see NAME --help)`) and exit code 2.
pub fn parse_args<T: Parser>(name: &str) -> Result<T, std::process::ExitCode> {
    use clap::error::ErrorKind;
    match T::try_parse() {
        Ok(args) => Ok(args),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            e.exit()
        }
        Err(e) => {
            let text = e.to_string();
            let first = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ");
            #[allow(clippy::print_stderr)]
            {
                eprintln!("{name}: {first} (see {name} --help)");
            }
            Err(std::process::ExitCode::from(2))
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--listen {0} is not a loopback address, so a token is required: pass --token-file")]
    TokenRequired(SocketAddr),
    #[error("token file {path}: {reason}")]
    TokenFile { path: String, reason: String },
    #[error("TLS file {path}: {reason}")]
    TlsFile { path: String, reason: String },
}

fn read_pem(path: &Path) -> Result<Vec<u8>, ConfigError> {
    let data = std::fs::read(path).map_err(|e| ConfigError::TlsFile {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    if !data.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(ConfigError::TlsFile {
            path: path.display().to_string(),
            reason: "not PEM".into(),
        });
    }
    Ok(data)
}

/// Reads a token file: one line, not empty.
pub fn read_token(path: &Path) -> Result<String, ConfigError> {
    let err = |reason: String| ConfigError::TokenFile {
        path: path.display().to_string(),
        reason,
    };
    let token = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let token = token.trim().to_string();
    if token.is_empty() {
        return Err(err("empty".into()));
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(err("must be one line without spaces".into()));
    }
    Ok(token)
}

/// The default state directory: `$XDG_STATE_HOME/corral/<name>`, else
/// `~/.local/state/corral/<name>`.
pub fn default_state_dir(name: &str) -> PathBuf {
    let base = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .unwrap_or_else(|| PathBuf::from("/var/lib"));
    base.join("corral").join(name)
}

impl WorkerArgs {
    /// The token, and the check that a non-loopback listener has one.
    pub fn token(&self) -> Result<Option<String>, ConfigError> {
        let token = self.token_file.as_deref().map(read_token).transpose()?;
        if token.is_none() && !self.listen.ip().is_loopback() {
            return Err(ConfigError::TokenRequired(self.listen));
        }
        Ok(token)
    }

    /// The TLS configuration, when --tls-cert is given.
    pub fn tls(&self) -> Result<Option<tonic::transport::ServerTlsConfig>, ConfigError> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let identity = tonic::transport::Identity::from_pem(read_pem(cert)?, read_pem(key)?);
        let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.tls_client_ca {
            tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(read_pem(ca)?));
        }
        Ok(Some(tls))
    }

    pub fn worker_config(&self) -> WorkerConfig {
        WorkerConfig {
            state_dir: self
                .state_dir
                .clone()
                .unwrap_or_else(|| default_state_dir("worker")),
            worker_id: self.worker_id.clone(),
            docker_host: self.docker_host.clone(),
            init_binary: self.init_binary.clone(),
            max_sandboxes: self.max_sandboxes,
            sweep_interval: self.sweep_interval,
            defaults: Defaults {
                image: self.default_image.clone(),
                ..Defaults::default()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_loopback_listen_needs_a_token() {
        let args = WorkerArgs::parse_from(["corral-worker", "--listen", "0.0.0.0:7070"]);
        assert!(matches!(args.token(), Err(ConfigError::TokenRequired(_))));
        let args = WorkerArgs::parse_from(["corral-worker", "--listen", "127.0.0.1:0"]);
        assert_eq!(args.token().unwrap(), None);
    }
}
