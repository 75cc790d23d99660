//! Templates (see [`crate::templates`]): kept after a build, named in a
//! create, and a sandbox made from one started and probed before the
//! create is answered.

use std::time::Duration;

use corral_proto::template::{Ready, START_OPERATION, TemplateStart};
use corral_proto::{OperationId, OperationSpec, Outcome, SandboxSpec, ShellSpec, pb};

use super::Worker;
use crate::error::{Result, WorkerError};
use crate::sandbox::Sandbox;
use crate::templates::Template;

/// How often a readiness probe is tried.
const PROBE_EVERY: Duration = Duration::from_millis(100);
/// The longest one try of a probe takes.
const PROBE_TRY: Duration = Duration::from_secs(5);

fn to_pb(t: &Template) -> pb::Template {
    pb::Template {
        name: t.name.clone(),
        image: t.image.clone(),
        start: Some(t.start.clone().into()),
        created_at_unix_ms: t.created_at_ms,
    }
}

impl Worker {
    /// Keeps `image` (just built) as `tenant`'s template `name`, pushed
    /// to the fleet's registry when there is one (unless it is there as it
    /// is already).
    pub async fn keep_template(
        &self,
        tenant: Option<String>,
        name: String,
        image: String,
        start: TemplateStart,
        seeded: bool,
    ) -> Result<pb::Template> {
        let most = self.inner.max_templates;
        if !self
            .inner
            .templates
            .has_room(tenant.as_deref(), &name, most)
        {
            return Err(WorkerError::Invalid(corral_proto::ProtocolError::invalid(
                "template",
                format!(
                    "at most {most} templates are kept for each tenant (remove one: corral template rm NAME)"
                ),
            )));
        }
        let before = self.inner.templates.get(tenant.as_deref(), &name);
        let mut t = Template {
            tenant,
            name,
            image,
            start,
            created_at_ms: self.now_ms(),
            registry_digest: None,
            seeded,
        };
        if let Some(reg) = &self.inner.registry {
            t.registry_digest = match before {
                Some(b)
                    if b.image == t.image && b.start == t.start && b.registry_digest.is_some() =>
                {
                    b.registry_digest
                }
                _ => match reg
                    .publish(t.tenant.as_deref(), &t.name, &t.image, &t.start, t.seeded)
                    .await
                {
                    Ok(d) => Some(d),
                    Err(e) => {
                        // Kept here all the same (this worker serves it);
                        // the client hears that the others cannot.
                        let file = self.inner.state.root().join("templates.json");
                        self.inner
                            .templates
                            .put(t.clone())
                            .map_err(|e| WorkerError::state(&file, e))?;
                        return Err(e.kept_here().into());
                    }
                },
            };
        }
        let file = self.inner.state.root().join("templates.json");
        self.inner
            .templates
            .put(t.clone())
            .map_err(|e| WorkerError::state(&file, e))?;
        tracing::info!(template = %t.name, image = %t.image, "template kept");
        Ok(to_pb(&t))
    }

    pub fn list_templates(&self, tenant: Option<&str>) -> Vec<pb::Template> {
        self.inner
            .templates
            .list(tenant)
            .iter()
            .map(to_pb)
            .collect()
    }

    /// Forgets `tenant`'s template `name`: whether there was one. In use
    /// (sandboxes of it here, or a pool of it), refused unless `force`.
    pub async fn delete_template(
        &self,
        tenant: Option<&str>,
        name: &str,
        force: bool,
    ) -> Result<bool> {
        corral_proto::template::check_name(name)?;
        if !force && self.inner.templates.get(tenant, name).is_some() {
            let of_it = |spec: &SandboxSpec| {
                spec.template.as_deref() == Some(name)
                    && super::tenant_of(spec).as_deref() == tenant
            };
            let users: Vec<String> = {
                let map = self.inner.table.lock();
                map.running()
                    .filter(|(_, s)| of_it(&s.spec))
                    .map(|(id, _)| id.to_string())
                    .chain(
                        map.checkpointed()
                            .filter(|(_, i)| of_it(&i.spec))
                            .map(|(id, _)| id.to_string()),
                    )
                    .collect()
            };
            let pooled = tenant.is_none()
                && super::lock(&self.inner.pools)
                    .iter()
                    .any(|p| p.template.template.as_deref() == Some(name));
            if !users.is_empty() || pooled {
                let mut why = Vec::new();
                if !users.is_empty() {
                    let shown: Vec<&str> = users.iter().take(5).map(String::as_str).collect();
                    why.push(format!(
                        "{} sandbox(es) of it run ({}{})",
                        users.len(),
                        shown.join(", "),
                        if users.len() > 5 { ", ..." } else { "" }
                    ));
                }
                if pooled {
                    why.push("a pool of it keeps members (--pool template:NAME)".to_string());
                }
                return Err(WorkerError::TemplateInUse {
                    template: name.to_string(),
                    why: why.join("; "),
                });
            }
        }
        // Out of the fleet's registry first: else this worker, or any,
        // would take it again at its next create.
        let mut withdrawn = false;
        if let Some(reg) = &self.inner.registry
            && let Some(digest) = reg.digest_of(tenant, name).await?
        {
            reg.withdraw(&digest).await?;
            withdrawn = true;
        }
        let file = self.inner.state.root().join("templates.json");
        let here = self
            .inner
            .templates
            .remove(tenant, name)
            .map_err(|e| WorkerError::state(&file, e))?;
        Ok(here || withdrawn)
    }

    /// The template `spec` names, for its tenant, with `spec`'s image set
    /// to the template's (`None`: it names none). With a registry, the one
    /// the registry has under its name now: pulled by its digest when this
    /// worker has another build of it, or none (a registry out of reach:
    /// what this worker has, said in its log).
    pub(super) async fn resolve_template(
        &self,
        spec: &mut SandboxSpec,
    ) -> Result<Option<Template>> {
        let Some(name) = spec.template.clone() else {
            return Ok(None);
        };
        let name = &name;
        let tenant = super::tenant_of(spec);
        let mut local = self.inner.templates.get(tenant.as_deref(), name);
        if let Some(reg) = &self.inner.registry {
            match reg.digest_of(tenant.as_deref(), name).await {
                Ok(Some(digest))
                    if local.as_ref().and_then(|t| t.registry_digest.as_ref()) != Some(&digest) =>
                {
                    let p = reg.fetch(&digest).await?;
                    let t = Template {
                        tenant: tenant.clone(),
                        name: name.clone(),
                        image: p.image,
                        start: p.start,
                        created_at_ms: self.now_ms(),
                        registry_digest: Some(p.digest),
                        seeded: p.seeded,
                    };
                    let file = self.inner.state.root().join("templates.json");
                    self.inner
                        .templates
                        .put(t.clone())
                        .map_err(|e| WorkerError::state(&file, e))?;
                    tracing::info!(template = %t.name, image = %t.image, "template taken from the registry");
                    local = Some(t);
                }
                // Withdrawn from the registry (removed through another
                // worker): a copy that came from there, or went there, is
                // forgotten here too.
                Ok(None) if local.as_ref().is_some_and(|t| t.registry_digest.is_some()) => {
                    let file = self.inner.state.root().join("templates.json");
                    self.inner
                        .templates
                        .remove(tenant.as_deref(), name)
                        .map_err(|e| WorkerError::state(&file, e))?;
                    tracing::info!(template = %name, "template withdrawn from the registry; forgotten here");
                    local = None;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(template = %name, error = %e, "the registry did not answer; this worker's template serves");
                }
            }
        }
        let t = local.ok_or_else(|| WorkerError::NoSuchTemplate(name.clone()))?;
        match &spec.image {
            None => spec.image = Some(t.image.clone()),
            Some(i) if *i == t.image => {}
            Some(other) => {
                return Err(WorkerError::Invalid(corral_proto::ProtocolError::invalid(
                    "image",
                    format!(
                        "{other:?}: a sandbox of template {name:?} runs its image ({})",
                        t.image
                    ),
                )));
            }
        }
        Ok(Some(t))
    }

    /// Starts a new sandbox of template `t` as it says, and waits until it
    /// is ready: an error says why not (the caller removes the sandbox).
    pub(super) async fn start_template(&self, sandbox: &Sandbox, t: &Template) -> Result<()> {
        let not_ready = |why: String| WorkerError::TemplateNotReady {
            template: t.name.clone(),
            why,
        };
        let deadline = tokio::time::Instant::now() + t.start.timeout();
        // A snapshot's workspace, before its start command.
        if t.seeded {
            self.seed_workspace(sandbox)
                .await
                .map_err(|e| not_ready(e.to_string()))?;
        }
        let started = match &t.start.command {
            Some(cmd) => {
                let id = OperationId::new(START_OPERATION)?;
                let mut spec = ShellSpec::new(cmd.clone());
                // It runs as long as its worker lets any command.
                spec.timeout_ms = Some(corral_proto::limits::MAX_TIMEOUT_MS);
                self.submit_to(sandbox, id.clone(), OperationSpec::Shell(spec), None)
                    .await?;
                Some(id)
            }
            None => None,
        };
        let Some(ready) = &t.start.ready else {
            return Ok(());
        };
        let mut tries = 0u32;
        loop {
            if sandbox.closed().is_cancelled() || sandbox.is_lost() {
                return Err(not_ready("the sandbox was lost while it started".into()));
            }
            // A start command that ended will not make it ready.
            if let Some(id) = &started
                && let Some(r) = sandbox.operation(id).and_then(|r| r.result)
            {
                return Err(not_ready(format!(
                    "its start command ended ({}): {}",
                    outcome_text(&r.outcome),
                    tail(&r.stderr.to_lossy_string())
                )));
            }
            tries += 1;
            // A command's probe bounds itself (and stops its command);
            // this bounds the others, and anything that would hang.
            let bound = PROBE_TRY + Duration::from_secs(1);
            let last = match tokio::time::timeout(bound, self.probe(sandbox, ready, tries)).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(why)) => why,
                Err(_) => format!("a probe took over {} s", bound.as_secs()),
            };
            if tokio::time::Instant::now() + PROBE_EVERY >= deadline {
                return Err(not_ready(format!(
                    "not ready within {} s (last probe: {last})",
                    t.start.timeout().as_secs()
                )));
            }
            tokio::time::sleep(PROBE_EVERY).await;
        }
    }

    /// One try of `ready`: why it does not hold yet.
    async fn probe(
        &self,
        sandbox: &Sandbox,
        ready: &Ready,
        n: u32,
    ) -> std::result::Result<(), String> {
        match ready {
            Ready::Port(port) => self.dial(sandbox, *port).await.map(drop),
            Ready::Http { port, path } => {
                let stream = self.dial(sandbox, *port).await?;
                let io = hyper_util::rt::TokioIo::new(stream);
                let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
                    .await
                    .map_err(|e| e.to_string())?;
                let conn = tokio::spawn(conn);
                let req = http::Request::get(path.as_str())
                    .header(http::header::HOST, format!("127.0.0.1:{port}"))
                    .body(http_body_util::Empty::<bytes::Bytes>::new())
                    .map_err(|e| e.to_string())?;
                let answer = sender.send_request(req).await.map_err(|e| e.to_string());
                conn.abort();
                let status = answer?.status();
                if status.is_success() || status.is_redirection() {
                    Ok(())
                } else {
                    Err(format!("GET {path} answered {status}"))
                }
            }
            Ready::Command(cmd) => {
                let id =
                    OperationId::new(format!("template-ready-{n}")).map_err(|e| e.to_string())?;
                let mut spec = ShellSpec::new(cmd.clone());
                spec.timeout_ms = Some(PROBE_TRY.as_millis() as u64);
                self.submit_to(sandbox, id.clone(), OperationSpec::Shell(spec), None)
                    .await
                    .map_err(|e| e.to_string())?;
                let given_up = tokio::time::Instant::now() + PROBE_TRY;
                loop {
                    if tokio::time::Instant::now() >= given_up {
                        // Not left running behind the next try.
                        let _ = sandbox.cancel(id.clone()).await;
                        return Err(format!("{cmd:?} took over {} s", PROBE_TRY.as_secs()));
                    }
                    if let Some(r) = sandbox.operation(&id).and_then(|r| r.result) {
                        return match r.outcome {
                            Outcome::Exited { code: 0 } => Ok(()),
                            other => Err(format!(
                                "{cmd:?} {}: {}",
                                outcome_text(&other),
                                tail(&r.stderr.to_lossy_string())
                            )),
                        };
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    /// A connection to `port` of the sandbox's loopback, through its way in.
    async fn dial(
        &self,
        sandbox: &Sandbox,
        port: u16,
    ) -> std::result::Result<crate::ports::ingress::PortStream, String> {
        let ingress = self.ingress_of(sandbox).await.map_err(|e| e.to_string())?;
        ingress.dial(port).await.map_err(|e| match e {
            crate::ports::ingress::DialError::NotListening(_) => {
                format!("nothing listens on port {port}")
            }
            other => other.to_string(),
        })
    }
}

fn outcome_text(o: &Outcome) -> String {
    match o {
        Outcome::Exited { code } => format!("exit {code}"),
        other => format!("{other:?}"),
    }
}

/// The end of what a command said, for a message.
fn tail(text: &str) -> String {
    let text = text.trim();
    let cut: String = text
        .chars()
        .rev()
        .take(300)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    if cut.is_empty() {
        "(nothing on stderr)".into()
    } else {
        cut
    }
}
