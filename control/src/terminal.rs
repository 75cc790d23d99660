//! The local terminal, for `corral exec -t`: its window size, raw mode
//! while a remote terminal is in use, and its size changes (SIGWINCH).

use std::os::fd::{AsFd, AsRawFd};

use corral_proto::TerminalSize;
use futures_util::Stream;
use nix::sys::termios::{self, SetArg, Termios};

nix::ioctl_read_bad!(tiocgwinsz, nix::libc::TIOCGWINSZ, nix::libc::winsize);

/// The window size of the terminal on `fd`, if it is one.
#[allow(unsafe_code)]
pub fn window_size(fd: &impl AsRawFd) -> Option<TerminalSize> {
    let mut ws = nix::libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize into the struct, which lives
    // for the call; a non-terminal fd fails with ENOTTY and writes nothing.
    unsafe { tiocgwinsz(fd.as_raw_fd(), &mut ws) }.ok()?;
    (ws.ws_row > 0 && ws.ws_col > 0).then_some(TerminalSize {
        rows: ws.ws_row,
        cols: ws.ws_col,
    })
}

/// The size of whichever of stdout or stdin is a terminal.
pub fn current_size() -> Option<TerminalSize> {
    window_size(&std::io::stdout()).or_else(|| window_size(&std::io::stdin()))
}

/// Raw mode on stdin while this lives: every key, Ctrl-C included, goes to
/// the remote terminal as it is typed. The old modes come back on drop.
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// `None` when stdin is not a terminal.
    pub fn enable() -> Option<Self> {
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(stdin.as_fd()).ok()?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).ok()?;
        if let Ok(mut s) = SAVED.lock() {
            *s = Some(saved.clone());
        }
        Some(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSADRAIN, &self.saved);
        if let Ok(mut s) = SAVED.lock() {
            *s = None;
        }
    }
}

/// The modes a live [`RawMode`] will give back: for a process that leaves
/// without unwinding.
static SAVED: std::sync::Mutex<Option<Termios>> = std::sync::Mutex::new(None);

/// Gives back the modes of a live [`RawMode`], if any (before an exit that
/// runs no destructor).
pub fn restore() {
    if let Ok(s) = SAVED.lock()
        && let Some(saved) = s.as_ref()
    {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, saved);
    }
}

/// The terminal's new size at every SIGWINCH.
pub fn resizes() -> std::io::Result<impl Stream<Item = TerminalSize> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let winch = signal(SignalKind::window_change())?;
    Ok(futures_util::stream::unfold(
        winch,
        |mut winch| async move {
            loop {
                winch.recv().await?;
                if let Some(size) = current_size() {
                    return Some((size, winch));
                }
            }
        },
    ))
}
