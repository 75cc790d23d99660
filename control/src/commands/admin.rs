//! `corral admin`: what an operator checks. `audit verify` exits 0 when the
//! log's chain is whole, 1 when it is broken (naming the first line that
//! is), 125 when the log cannot be read.

use std::io::Write;

use corral_harness::audit::{AuditError, verify};

use crate::cli::{AdminCommand, AuditCommand};

pub fn main(cmd: &AdminCommand) -> u8 {
    match cmd {
        AdminCommand::Audit(AuditCommand::Verify { file }) => match verify(file) {
            Ok(n) => {
                let _ = writeln!(
                    std::io::stdout(),
                    "{}: {n} records, the chain is whole",
                    file.display()
                );
                0
            }
            Err(e @ AuditError::Broken { .. }) => {
                super::report(&e);
                1
            }
            Err(e) => {
                super::report(&e);
                super::EXIT_CORRAL_ERROR
            }
        },
    }
}
