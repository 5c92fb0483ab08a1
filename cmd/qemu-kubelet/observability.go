package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"k8s.io/klog/v2"
)

// observabilityOptions are the flags of the metrics endpoint. Tracing is
// configured with the standard OTEL_* environment variables
// (tracingFromEnv).
type observabilityOptions struct {
	metricsAddr string
}

func (o *observabilityOptions) addFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.metricsAddr, "metrics-bind-address", "0",
		"address of the Prometheus /metrics endpoint (plain HTTP), e.g. :10255 or 127.0.0.1:10255; 0 disables it")
}

// Trace protocols of OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL.
const (
	protocolHTTP = "http/protobuf"
	protocolGRPC = "grpc"
)

// tracingConfig is what the environment asks for: no export (Protocol "")
// or OTLP over Protocol.
type tracingConfig struct {
	Protocol string
	Endpoint string // for the log; the exporter reads the variables itself
}

// tracingFromEnv decides from the OpenTelemetry SDK environment variables
// whether and how spans are exported: OTLP when OTEL_EXPORTER_OTLP_ENDPOINT
// or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set or OTEL_TRACES_EXPORTER=otlp;
// nothing when none is, or OTEL_TRACES_EXPORTER=none, or OTEL_SDK_DISABLED=true.
func tracingFromEnv(getenv func(string) string) (tracingConfig, error) {
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") {
		return tracingConfig{}, nil
	}
	endpoint := getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
	if endpoint == "" {
		endpoint = getenv("OTEL_EXPORTER_OTLP_ENDPOINT")
	}
	switch exp := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); exp {
	case "none":
		return tracingConfig{}, nil
	case "":
		if endpoint == "" {
			return tracingConfig{}, nil
		}
	case "otlp":
	default:
		return tracingConfig{}, fmt.Errorf("OTEL_TRACES_EXPORTER=%q: supported values are otlp and none", exp)
	}
	proto := getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if proto == "" {
		proto = getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	switch proto {
	case "", protocolHTTP:
		proto = protocolHTTP
	case protocolGRPC:
	default:
		return tracingConfig{}, fmt.Errorf("OTLP protocol %q: supported values are %s and %s", proto, protocolHTTP, protocolGRPC)
	}
	return tracingConfig{Protocol: proto, Endpoint: endpoint}, nil
}

// observability is the node agent's telemetry: the Prometheus registry
// behind /metrics and the tracer provider of the pod.start spans.
type observability struct {
	registry  *prometheus.Registry
	telemetry *telemetry.Telemetry
	tp        *sdktrace.TracerProvider // nil: spans are not exported
	server    *http.Server
	addr      net.Addr // where /metrics listens; nil: disabled
}

// newRegistry is the registry /metrics serves: Go runtime and process
// collectors plus the provider's metrics.
func newRegistry() (*prometheus.Registry, *telemetry.Metrics, error) {
	reg := prometheus.NewRegistry()
	m, err := telemetry.RegisterMetrics(reg)
	if err != nil {
		return nil, nil, err
	}
	return reg, m, nil
}

// startObservability creates the registry and tracer provider and, unless
// disabled, serves /metrics (until close).
func startObservability(ctx context.Context, o observabilityOptions, nodeName string, getenv func(string) string) (*observability, error) {
	logger := klog.FromContext(ctx)
	reg, m, err := newRegistry()
	if err != nil {
		return nil, err
	}
	obs := &observability{registry: reg}
	tc, err := tracingFromEnv(getenv)
	if err != nil {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	var tp trace.TracerProvider
	if tc.Protocol != "" {
		if obs.tp, err = newTracerProvider(ctx, tc, nodeName); err != nil {
			return nil, err
		}
		tp = obs.tp
		logger.Info("Exporting traces over OTLP", "protocol", tc.Protocol, "endpoint", tc.Endpoint)
	}
	obs.telemetry = telemetry.NewTelemetry(m, tp)

	if o.metricsAddr != "" && o.metricsAddr != "0" {
		l, err := net.Listen("tcp", o.metricsAddr)
		if err != nil {
			obs.close(ctx)
			return nil, fmt.Errorf("metrics endpoint (--metrics-bind-address %s): %w", o.metricsAddr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		obs.server = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		obs.addr = l.Addr()
		go func() {
			if err := obs.server.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				logger.Error(err, "Metrics endpoint stopped", "address", obs.addr.String())
			}
		}()
		logger.Info("Serving Prometheus metrics", "address", obs.addr.String(), "path", "/metrics")
	}
	return obs, nil
}

// newTracerProvider exports spans over OTLP; the exporter reads the
// OTEL_EXPORTER_OTLP_* variables (endpoint, headers, TLS, timeout) itself.
// The resource carries service.name qemu-kubelet (OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES override), the version and the node name.
func newTracerProvider(ctx context.Context, tc tracingConfig, nodeName string) (*sdktrace.TracerProvider, error) {
	var exp sdktrace.SpanExporter
	var err error
	switch tc.Protocol {
	case protocolGRPC:
		exp, err = otlptracegrpc.New(ctx)
	default:
		exp, err = otlptracehttp.New(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("OTLP trace exporter (%s): %w", tc.Protocol, err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(
			attribute.String("service.name", "qemu-kubelet"),
			attribute.String("service.version", version),
			attribute.String("k8s.node.name", nodeName),
		),
		resource.WithFromEnv(),
		resource.WithHost(),
	)
	if err != nil {
		return nil, fmt.Errorf("trace resource: %w", err)
	}
	otel.SetLogger(klog.FromContext(ctx).WithName("otel"))
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}

// register adds the scrape-time state (running VMs, image cache).
func (o *observability) register(vms *provider.VMs, images *oci.Store) error {
	if err := o.registry.Register(telemetry.StateCollector{VMs: vms, Images: images}); err != nil {
		return fmt.Errorf("register state metrics: %w", err)
	}
	return nil
}

// close stops /metrics and flushes the spans not exported yet (bounded).
func (o *observability) close(ctx context.Context) {
	logger := klog.FromContext(ctx)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if o.server != nil {
		_ = o.server.Shutdown(ctx)
	}
	if o.tp != nil {
		if err := o.tp.Shutdown(ctx); err != nil {
			logger.Error(err, "Flush traces")
		}
	}
}
