//! A real OTLP/gRPC trace receiver (the collector's trace service, served
//! by tonic on loopback) for the tests and benchmark of traces: it keeps
//! every span it is sent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;

/// A span as received: its service, ids, name, attributes, events.
#[derive(Debug, Clone)]
pub struct Got {
    pub service: String,
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    pub parent: Vec<u8>,
    pub name: String,
    pub attrs: HashMap<String, String>,
    pub events: Vec<String>,
}

#[derive(Clone, Default)]
pub struct Receiver {
    got: Arc<Mutex<Vec<Got>>>,
    /// Requests of more spans than this are refused, as a collector refuses
    /// one over its size bound (0: none is).
    max_spans: usize,
    refused: Arc<std::sync::atomic::AtomicUsize>,
}

fn text(kv: &[KeyValue]) -> HashMap<String, String> {
    kv.iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(AnyValue::StringValue(s)) => s.clone(),
                Some(AnyValue::IntValue(i)) => i.to_string(),
                Some(AnyValue::BoolValue(b)) => b.to_string(),
                Some(AnyValue::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let req = req.into_inner();
        let spans: usize = req
            .resource_spans
            .iter()
            .flat_map(|rs| &rs.scope_spans)
            .map(|ss| ss.spans.len())
            .sum();
        if self.max_spans > 0 && spans > self.max_spans {
            self.refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(tonic::Status::resource_exhausted(format!(
                "{spans} spans in one request, over the bound of {}",
                self.max_spans
            )));
        }
        let mut got = self.got.lock().unwrap_or_else(|e| e.into_inner());
        for rs in req.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .map(|r| text(&r.attributes))
                .and_then(|a| a.get("service.name").cloned())
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(Got {
                        service: service.clone(),
                        trace_id: s.trace_id,
                        span_id: s.span_id,
                        parent: s.parent_span_id,
                        name: s.name,
                        attrs: text(&s.attributes),
                        events: s.events.into_iter().map(|e| e.name).collect(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// A receiver that refuses every request of more than `max_spans`.
    pub fn refusing_more_than(max_spans: usize) -> Self {
        Self {
            max_spans,
            ..Self::default()
        }
    }

    /// Requests refused so far.
    pub fn refused(&self) -> usize {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Serves on 127.0.0.1 (a free port); its `http://` address.
    pub async fn serve(&self) -> Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let svc = TraceServiceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok(format!("http://{addr}"))
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Got> {
        self.got.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
