//! What a Corral process needs as it starts, shared by `corral-worker` and
//! `corral`: its arguments parsed (with clap's errors as exit codes), its
//! logs set up, its bearer tokens and TLS certificates read (refused when
//! others may read them), and its default state directory.

use std::path::{Path, PathBuf};

use clap::Parser;

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Text on a terminal, JSON otherwise (a log collector).
    Auto,
    Text,
    Json,
}

/// Logs to stderr, filtered by `CORRAL_LOG` (default `default_level`):
/// text (in colour) on a terminal, one JSON object per line otherwise,
/// unless `format` says which.
pub fn init_logging(default_level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CORRAL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let json = match format {
        LogFormat::Auto => !terminal,
        LogFormat::Text => false,
        LogFormat::Json => true,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init();
    } else {
        let fields = log_fields();
        builder.fmt_fields(fields).with_ansi(terminal).init();
    }
}

/// How a text log line writes its fields. They can hold a sandbox's words
/// (a file name, an error it caused, a reason its supervisor gave): shown
/// with their control characters made visible, the carriage returns,
/// bidirectional controls and new lines the default format lets through
/// included, so that no field moves the cursor or fakes a line of its own.
pub fn log_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + Send + Sync + 'static
{
    use tracing_subscriber::field::MakeExt as _;
    tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
        let shown = format!("{value:?}");
        let shown = corral_proto::text::printable(&shown).replace('\n', "\\n");
        if field.name() == "message" {
            write!(w, "{shown}")
        } else {
            write!(w, "{field}={shown}")
        }
    })
    .delimited(" ")
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
    #[error("token file {path}: {reason}")]
    TokenFile { path: String, reason: String },
    #[error("{0}")]
    Policy(String),
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

/// A server's TLS: its certificate and key, and for mutual TLS the CA its
/// clients' certificates must be signed by. It offers HTTP/2 (`h2`, gRPC)
/// and HTTP/1.1 (the HTTP/JSON API's clients that speak nothing else, such
/// as Node's `fetch`) by ALPN. Handshakes are done by [`crate::admission`].
#[derive(Clone)]
pub struct ServerTls(pub(crate) tokio_rustls::TlsAcceptor);

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

impl ServerTls {
    /// From PEM: the certificate chain, its key, and the clients' CA.
    pub fn from_pem(cert: &[u8], key: &[u8], client_ca: Option<&[u8]>) -> Result<Self, String> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        use tokio_rustls::rustls;
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("the certificate: {e}"))?;
        if chain.is_empty() {
            return Err("the certificate: no CERTIFICATE block".into());
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("the key: {e}"))?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_slice_iter(ca) {
                    let c = c.map_err(|e| format!("the client CA: {e}"))?;
                    roots.add(c).map_err(|e| format!("the client CA: {e}"))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    roots.into(),
                    provider,
                )
                .build()
                .map_err(|e| format!("the client CA: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| format!("the certificate and its key: {e}"))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(
            config,
        ))))
    }
}

/// A server's TLS from its certificate and key (PEM files), requiring
/// client certificates signed by `client_ca` when given (mutual TLS);
/// `None` without a certificate.
pub fn server_tls(
    cert: Option<&Path>,
    key: Option<&Path>,
    client_ca: Option<&Path>,
) -> Result<Option<ServerTls>, ConfigError> {
    let (Some(cert), Some(key)) = (cert, key) else {
        return Ok(None);
    };
    let ca = client_ca.map(read_pem).transpose()?;
    ServerTls::from_pem(&read_pem(cert)?, &read_pem(key)?, ca.as_deref())
        .map(Some)
        .map_err(|reason| ConfigError::TlsFile {
            path: cert.display().to_string(),
            reason,
        })
}

/// The shortest token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

/// Reads a token file: one line of at least 16 characters, in a file no
/// other user can read or write.
pub fn read_token(path: &Path) -> Result<String, ConfigError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |reason: String| ConfigError::TokenFile {
        path: path.display().to_string(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(err(format!(
            "other users can read or write it (mode {mode:03o}): chmod 600 {}",
            path.display()
        )));
    }
    let token = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let token = token.trim().to_string();
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(err("must be one line without spaces".into()));
    }
    let n = token.chars().count();
    if n < MIN_TOKEN_CHARS {
        return Err(err(format!(
            "too short ({n} characters; at least {MIN_TOKEN_CHARS}): make one with `head -c 32 /dev/urandom | base64 | tr -d '/+=' > FILE`"
        )));
    }
    Ok(token)
}

/// A new random token: 64 hex digits (256 bits from the system's CSPRNG).
pub fn new_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// The token in `path`, made (random, mode 0600) if the file does not
/// exist yet.
pub fn token_or_new(path: &Path) -> Result<String, ConfigError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if !path.exists() {
        let err = |reason: String| ConfigError::TokenFile {
            path: path.display().to_string(),
            reason,
        };
        if let Some(dir) = path.parent() {
            crate::state::private_dir(dir).map_err(|e| err(e.to_string()))?;
        }
        let token = new_token();
        let tmp = path.with_extension("new");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| err(e.to_string()))?;
        f.write_all(format!("{token}\n").as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| err(e.to_string()))?;
        // Never overwrite a token another start just made.
        std::fs::hard_link(&tmp, path)
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Ok(()),
                _ => Err(e),
            })
            .map_err(|e| err(e.to_string()))?;
        let _ = std::fs::remove_file(&tmp);
    }
    read_token(path)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_line_shows_hostile_fields_escaped_on_one_line() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(log_fields())
            .with_ansi(false)
            .with_writer(move || out.clone())
            .finish();
        // A name and an error as a sandbox could make them: a carriage
        // return that hides the line's start, a reversed run, a fake line.
        let name = "ok\rEVIL \u{202e}gnp.exe";
        let error = std::io::Error::other("boom\n2026-01-01 INFO all is well\x1b[2J");
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(file = name, error = %error, "fork note");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{text:?}"
        );
        assert!(!text.contains('\u{202e}'), "{text:?}");
        assert!(text.contains("fork note"), "{text}");
        assert!(text.contains("error=boom\\n2026"), "{text}");
    }

    #[test]
    fn short_or_shared_token_files_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        std::fs::write(&path, "x\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = read_token(&path).unwrap_err().to_string();
        assert!(e.contains("too short"), "{e}");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_token(&path).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(read_token(&path).unwrap(), "0123456789abcdef0123");
    }
}
