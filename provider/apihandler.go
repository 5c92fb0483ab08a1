package provider

import (
	"net/http"
	"time"

	"github.com/gorilla/mux"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
)

// Kubelet streaming defaults: a session may stay idle this long (the
// kubelet's streamingConnectionIdleTimeout), and a client has this long to
// open its streams after the upgrade.
const (
	DefaultStreamIdleTimeout     = 4 * time.Hour
	DefaultStreamCreationTimeout = 30 * time.Second
)

// KubeletAPIHandler is api.PodHandler (virtual-kubelet v1.13) with the
// port-forward route fixed: PodHandler passes StreamCreationTimeout as the
// port-forward idle timeout and StreamIdleTimeout as its creation timeout
// (swapped), so a quiet `kubectl port-forward` would be cut after the
// creation timeout. Here port-forward gets them the right way round; every
// other route is PodHandler's. Zero timeouts take the kubelet defaults
// above (PodHandler's own default, 30 s idle, would also end an idle
// `kubectl attach -it` after 30 s).
func KubeletAPIHandler(cfg api.PodHandlerConfig, debug bool) http.Handler {
	if cfg.StreamIdleTimeout <= 0 {
		cfg.StreamIdleTimeout = DefaultStreamIdleTimeout
	}
	if cfg.StreamCreationTimeout <= 0 {
		cfg.StreamCreationTimeout = DefaultStreamCreationTimeout
	}
	r := mux.NewRouter()
	r.StrictSlash(true)
	r.HandleFunc("/portForward/{namespace}/{pod}", api.HandlePortForward(cfg.PortForward,
		api.WithPortForwardStreamIdleTimeout(cfg.StreamIdleTimeout),
		api.WithPortForwardCreationTimeout(cfg.StreamCreationTimeout),
	)).Methods("POST", "GET")
	r.NotFoundHandler = api.PodHandler(cfg, debug)
	return r
}
