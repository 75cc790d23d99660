//! `corral serve`: see [`crate::serve`]. Exit codes: 0 stopped by a
//! signal, 2 usage error, 125 the service failed.

use crate::cli::{ConnArgs, ServeArgs};

pub async fn main(conn: &ConnArgs, args: &ServeArgs) -> u8 {
    match crate::serve::serve(conn, args).await {
        Ok(()) => 0,
        Err(e) => {
            super::report(&e);
            if e.is_usage() {
                super::EXIT_USAGE
            } else {
                super::EXIT_CORRAL_ERROR
            }
        }
    }
}
