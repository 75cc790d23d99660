//! `corral local-worker`: the shared local worker process (started by
//! `corral` itself; see [`crate::local`]).

use std::time::Duration;

use crate::cli::ConnArgs;

pub async fn main(conn: &ConnArgs, idle: Duration) -> u8 {
    let state = crate::local::state_dir(conn.state_dir.as_deref());
    match crate::local::serve(&state, conn.docker_host.clone(), idle).await {
        Ok(()) => 0,
        Err(e) => {
            super::report(&e);
            super::EXIT_CORRAL_ERROR
        }
    }
}
