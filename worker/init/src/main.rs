//! `corral-init`: PID 1 of every Corral sandbox. See the library docs.

// A binary talks to its terminal; the libraries never print.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;

fn main() -> ExitCode {
    // `--keep`: a command's keeper, spawned by the supervisor (its orders
    // on descriptor 3; see corral_init::keeper). First: it reads nothing
    // else.
    if std::env::args_os().nth(1).as_deref() == Some(corral_init::keeper::KEEP_FLAG.as_ref()) {
        corral_init::keeper::run();
    }
    if std::env::args().nth(1).as_deref() == Some("--version") {
        println!("corral-init {}", corral_init::VERSION);
        return ExitCode::SUCCESS;
    }
    // `--install SRC DST`: the worker's helper puts a freshly copied binary
    // into place atomically (rename), inside the supervisor volume.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, src, dst] = args.as_slice()
        && flag == "--install"
    {
        return match std::fs::rename(src, dst) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("corral-init: installing {src} as {dst}: {e}");
                ExitCode::from(1)
            }
        };
    }
    // `--copy-tree FROM_PID TO_PID USER_FROM:USER_TO PATH...`: a fork's
    // copy, run by the worker on the host (never in a sandbox). Prints
    // `copied ENTRIES BYTES LEFT_OUT`, then a `note:` line each.
    if let [flag, from, to, user, paths @ ..] = args.as_slice()
        && flag == "--copy-tree"
    {
        // Gone with the worker that started it.
        let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
        let parsed = (
            from.parse::<u32>(),
            to.parse::<u32>(),
            user.split_once(':')
                .map(|(a, b)| (a.parse::<u32>(), b.parse::<u32>())),
        );
        let (Ok(from), Ok(to), Some((Ok(a), Ok(b)))) = parsed else {
            eprintln!("corral-init: --copy-tree FROM_PID TO_PID USER_FROM:USER_TO PATH...");
            return ExitCode::from(2);
        };
        let user = (a != b).then_some((a, b));
        return match corral_init::treecopy::run(from, to, user, paths) {
            Ok(done) => {
                println!("copied {} {} {}", done.entries, done.bytes, done.left_out);
                for n in done.notes {
                    println!("note: {n}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(1)
            }
        };
    }
    // `--check-restrictions`: what a program in this sandbox meets.
    if args.first().map(String::as_str) == Some("--check-restrictions") {
        for line in corral_init::syscalls::check() {
            println!("{line}");
        }
        return ExitCode::SUCCESS;
    }
    // `--egress-relay`: the sandbox's egress relay, started by the
    // supervisor with the bound listener as descriptor 3.
    if args.first().map(String::as_str) == Some("--egress-relay") {
        let _ = nix::sys::prctl::set_dumpable(false);
        // SAFETY: descriptor 3 is the listener the supervisor passed, owned
        // by nothing else in this process.
        #[allow(unsafe_code)]
        let listener = unsafe { <std::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(3) };
        let socket = std::path::Path::new(corral_init::relay::SOCKET_DIR)
            .join(corral_init::relay::SOCKET_NAME);
        let e = corral_init::relay::serve(listener, &socket);
        eprintln!("corral-init: egress relay: {e}");
        return ExitCode::from(1);
    }
    // `--ingress-relay`: the way in, started by the supervisor when the
    // worker asks (see corral_init::ingress).
    if args.first().map(String::as_str) == Some("--ingress-relay") {
        let _ = nix::sys::prctl::set_dumpable(false);
        let socket = std::path::Path::new(corral_init::relay::SOCKET_DIR)
            .join(corral_init::ingress::SOCKET_NAME);
        // Its secret, from the supervisor (hex): the worker's word that
        // this relay is the sandbox's own.
        let secret: Vec<u8> = std::env::var(corral_init::ingress::SECRET_ENV)
            .ok()
            .and_then(|h| {
                (0..h.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
                    .collect()
            })
            .unwrap_or_default();
        let e = corral_init::ingress::serve(&socket, &secret);
        // No worker listens (it restarted, and has exposed nothing since),
        // or the worker closed the way in (it stopped, or let go of the
        // relay for a checkpoint): not started again until the worker asks.
        if matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionRefused
                | std::io::ErrorKind::NotFound
                | std::io::ErrorKind::UnexpectedEof
        ) {
            return ExitCode::from(corral_init::ingress::NO_WORKER);
        }
        eprintln!("corral-init: ingress relay: {e}");
        return ExitCode::from(1);
    }
    // Closed before anything runs, for the supervisor and all it starts.
    if let Err(e) = corral_init::syscalls::restrict() {
        eprintln!("corral-init: {e}");
        return ExitCode::from(70);
    }
    // `--roots WORKSPACE TMP [--finished-budget BYTES]` runs outside a
    // sandbox (the supervisor's own tests).
    let mut config = corral_init::supervisor::Config::default();
    // `--command-uid UID`: the supervisor runs as root, commands as UID;
    // `--egress`: the sandbox has egress (its worker's socket is mounted);
    // `--root PATH`: a volume mounted there (repeated).
    if args.first().map(String::as_str) != Some("--roots") {
        // The container starts in the image's WORKDIR (or the workspace,
        // for an image that names none): so do commands.
        config.workdir = std::env::current_dir().ok();
        let mut rest = args.iter();
        while let Some(flag) = rest.next() {
            match flag.as_str() {
                "--command-uid" => match rest.next().map(|u| u.parse()) {
                    Some(Ok(uid)) => config.command_uid = Some(uid),
                    _ => {
                        eprintln!("corral-init: --command-uid needs a user id");
                        return ExitCode::from(2);
                    }
                },
                "--egress" => config.egress = true,
                // A volume's mount: files may be read and written there too.
                "--root" => match rest.next() {
                    Some(p) if p.starts_with('/') => config.roots.others.push(p.into()),
                    _ => {
                        eprintln!("corral-init: --root needs an absolute path");
                        return ExitCode::from(2);
                    }
                },
                other => {
                    eprintln!("corral-init: unknown argument {other:?}");
                    return ExitCode::from(2);
                }
            }
        }
    }
    // In a sandbox (not under `--roots`): the sandbox user's name, before
    // anything runs. An image that does not look there loses nothing.
    if args.first().map(String::as_str) != Some("--roots")
        && let Err(e) = corral_init::users::write(
            std::path::Path::new(corral_init::users::USERS_DIR),
            std::path::Path::new("/etc"),
            config.command_uid,
        )
    {
        eprintln!("corral-init: writing the sandbox's user database: {e}");
    }
    if let [flag, workspace, tmp, rest @ ..] = args.as_slice()
        && flag == "--roots"
    {
        config.roots = corral_init::fileops::Roots {
            workspace: workspace.into(),
            others: vec![tmp.into()],
        };
        if let [flag, n] = rest
            && flag == "--finished-budget"
            && let Ok(n) = n.parse()
        {
            config.finished_budget_bytes = n;
        }
    }
    match corral_init::supervisor::run(config) {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("corral-init: {e}");
            ExitCode::from(70)
        }
    }
}
