package main

import (
	"context"
	"flag"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

func TestTracingFromEnv(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		want    tracingConfig
		wantErr string
	}{
		{name: "nothing set: no export", env: nil, want: tracingConfig{}},
		{name: "endpoint: http/protobuf by default", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
			want: tracingConfig{Protocol: protocolHTTP, Endpoint: "http://c:4318"}},
		{name: "traces endpoint wins", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4318/v1/traces"},
			want: tracingConfig{Protocol: protocolHTTP, Endpoint: "http://b:4318/v1/traces"}},
		{name: "grpc", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
			want: tracingConfig{Protocol: protocolGRPC, Endpoint: "http://c:4317"}},
		{name: "traces protocol wins", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
			want: tracingConfig{Protocol: protocolGRPC, Endpoint: "http://c:4317"}},
		{name: "exporter otlp without endpoint: SDK default endpoint", env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp"},
			want: tracingConfig{Protocol: protocolHTTP}},
		{name: "exporter none", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, want: tracingConfig{}},
		{name: "sdk disabled", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, want: tracingConfig{}},
		{name: "unsupported exporter named", env: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, wantErr: `OTEL_TRACES_EXPORTER="zipkin"`},
		{name: "unsupported protocol named", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, wantErr: `"http/json"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tracingFromEnv(func(k string) string { return tt.env[k] })
			if tt.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

// TestMetricsFlag: the flag the Helm chart passes is accepted by the binary
// (an unknown flag makes run return 2).
func TestMetricsFlag(t *testing.T) {
	old := os.Args
	t.Cleanup(func() { os.Args = old })
	os.Args = []string{"qemu-kubelet", "--metrics-bind-address=:10255", "--version"}
	assert.Equal(t, 0, run())
	os.Args = []string{"qemu-kubelet", "--no-such-flag", "--version"}
	assert.Equal(t, 2, run(), "unknown flags are refused: the check above can fail")

	var o observabilityOptions
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	o.addFlags(fs)
	assert.Equal(t, "0", o.metricsAddr, "off by default")
	require.NoError(t, fs.Parse([]string{"--metrics-bind-address=127.0.0.1:9999"}))
	assert.Equal(t, "127.0.0.1:9999", o.metricsAddr)
}

func scrapeText(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return fams
}

// TestMetricsEndpoint serves /metrics as the binary does and lints every
// metric family it exposes (Go runtime, process and qemu-kubelet's own).
func TestMetricsEndpoint(t *testing.T) {
	ctx := context.Background()
	noEnv := func(string) string { return "" }

	off, err := startObservability(ctx, observabilityOptions{metricsAddr: "0"}, "n1", noEnv)
	require.NoError(t, err)
	assert.Nil(t, off.addr, "0 disables the endpoint")
	assert.NotNil(t, off.telemetry)
	off.close(ctx)

	obs, err := startObservability(ctx, observabilityOptions{metricsAddr: "127.0.0.1:0"}, "n1", noEnv)
	require.NoError(t, err)
	t.Cleanup(func() { obs.close(ctx) })
	require.NoError(t, obs.register(nil, nil))
	url := "http://" + obs.addr.String() + "/metrics"
	fams := scrapeText(t, url)
	for _, n := range []string{telemetry.MetricImagePulls, telemetry.MetricVMExits, telemetry.MetricVMStartDuration, telemetry.MetricVMStartPhaseSeconds,
		"go_goroutines", "process_start_time_seconds"} {
		assert.Contains(t, fams, n)
	}
	var mfs []*dto.MetricFamily
	for _, f := range fams {
		mfs = append(mfs, f)
	}
	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	require.NoError(t, err)
	assert.Empty(t, problems, "promlint")

	// The port is taken: a clear error naming the flag.
	_, err = startObservability(ctx, observabilityOptions{metricsAddr: obs.addr.String()}, "n1", noEnv)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "--metrics-bind-address "+obs.addr.String())
	_, err = startObservability(ctx, observabilityOptions{metricsAddr: "nonsense"}, "n1", noEnv)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "--metrics-bind-address nonsense")
}

// otlpSink collects the spans of OTLP export requests.
type otlpSink struct {
	collectortrace.UnimplementedTraceServiceServer
	mu       sync.Mutex
	spans    []string
	resource map[string]string
}

func (s *otlpSink) add(req *collectortrace.ExportTraceServiceRequest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		if s.resource == nil {
			s.resource = map[string]string{}
		}
		for _, kv := range rs.GetResource().GetAttributes() {
			s.resource[kv.GetKey()] = kv.GetValue().GetStringValue()
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				s.spans = append(s.spans, sp.GetName())
			}
		}
	}
}

func (s *otlpSink) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	s.add(req)
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func (s *otlpSink) get() ([]string, map[string]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.spans...), s.resource
}

// TestOTLPExport: with the standard environment variables set, spans reach
// a real OTLP receiver over HTTP and over gRPC, with the node's resource
// attributes; close flushes them.
func TestOTLPExport(t *testing.T) {
	ctx := context.Background()
	for _, protocol := range []string{protocolHTTP, protocolGRPC} {
		t.Run(protocol, func(t *testing.T) {
			sink := &otlpSink{}
			var endpoint string
			if protocol == protocolHTTP {
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if r.URL.Path != "/v1/traces" {
						http.NotFound(w, r)
						return
					}
					sink.add(decodeExport(t, r.Body))
					w.Header().Set("Content-Type", "application/x-protobuf")
					b, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
					_, _ = w.Write(b)
				}))
				t.Cleanup(srv.Close)
				endpoint = srv.URL
			} else {
				l, err := net.Listen("tcp", "127.0.0.1:0")
				require.NoError(t, err)
				gs := grpc.NewServer()
				collectortrace.RegisterTraceServiceServer(gs, sink)
				go func() { _ = gs.Serve(l) }()
				t.Cleanup(gs.Stop)
				endpoint = "http://" + l.Addr().String()
			}
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
			t.Setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
			obs, err := startObservability(ctx, observabilityOptions{metricsAddr: "0"}, "node-7", os.Getenv)
			require.NoError(t, err)
			require.NotNil(t, obs.tp, "tracing enabled by the environment")
			_, span := obs.tp.Tracer("test").Start(ctx, "probe-span")
			span.End()
			obs.close(ctx) // flushes
			require.Eventually(t, func() bool { s, _ := sink.get(); return len(s) > 0 }, 10*time.Second, 50*time.Millisecond)
			spans, res := sink.get()
			assert.Equal(t, []string{"probe-span"}, spans)
			assert.Equal(t, "qemu-kubelet", res["service.name"])
			assert.Equal(t, "node-7", res["k8s.node.name"])
			assert.Equal(t, version, res["service.version"])
		})
	}
}

func decodeExport(t *testing.T, r io.Reader) *collectortrace.ExportTraceServiceRequest {
	b, err := io.ReadAll(r)
	if err != nil {
		t.Error(err)
		return nil
	}
	req := &collectortrace.ExportTraceServiceRequest{}
	if err := proto.Unmarshal(b, req); err != nil {
		t.Errorf("decode OTLP request: %v", err)
	}
	return req
}
