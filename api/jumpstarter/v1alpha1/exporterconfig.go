package v1alpha1

import (
	"errors"
	"fmt"
	"sort"

	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"
)

// Where an exporter's ExporterConfig travels: upstream's ExporterSet
// reconciler writes it, as YAML under ExporterConfigSecretKey, into the
// Secret ExporterConfigSecretName(exporter) of the exporter's namespace,
// and the exporter's pod mounts that Secret at ExporterConfigMountPath.
const (
	ExporterConfigKind         = "ExporterConfig"
	ExporterConfigSecretPrefix = "exporter-config-"
	ExporterConfigSecretKey    = "config.yaml"
	ExporterConfigMountPath    = "/etc/jumpstarter/exporters"
)

// ExporterConfigSecretName is the name of the Secret holding the
// ExporterConfig of the named Exporter.
func ExporterConfigSecretName(exporter string) string { return ExporterConfigSecretPrefix + exporter }

// ExporterConfig is a Jumpstarter exporter's configuration file
// (apiVersion jumpstarter.dev/v1alpha1, kind ExporterConfig): not an API
// resource but the YAML document an exporter starts from. These are the
// fields upstream's ExporterSet reconciler writes for each exporter it
// creates (controller/internal/exporterset/exporterconfig.go at b1f2bb41),
// with the same JSON names. The exporter's own reader (upstream's Python
// ExporterConfigV1Alpha1) accepts more (hooks, grpcOptions, description,
// tls.insecure, ...); the project neither writes nor reads those, and
// ParseExporterConfig ignores them as that reader ignores unknown keys.
type ExporterConfig struct {
	APIVersion string                 `json:"apiVersion"`
	Kind       string                 `json:"kind"`
	Metadata   ExporterConfigMetadata `json:"metadata"`
	// Endpoint is the controller's gRPC endpoint (the Exporter's
	// status.endpoint).
	Endpoint string `json:"endpoint"`
	// TLS: the CA the exporter trusts for the endpoint and the routers.
	TLS *ExporterConfigTLS `json:"tls,omitempty"`
	// Token is the exporter's credential (the token of the Exporter's
	// status.credential Secret).
	Token string `json:"token"`
	// Export is the exporter's driver tree, by name.
	Export map[string]ExporterConfigDriver `json:"export,omitempty"`
	// ExitOnLeaseEnd: the exporter exits when a lease ends (upstream
	// writes true unless the set's recycle strategy is InPlaceReuse).
	ExitOnLeaseEnd bool `json:"exitOnLeaseEnd"`
}

// ExporterConfigMetadata names the Exporter the configuration is for.
type ExporterConfigMetadata struct {
	Name      string `json:"name"`
	Namespace string `json:"namespace"`
}

// ExporterConfigTLS holds the CA bundle, PEM encoded then base64 encoded.
type ExporterConfigTLS struct {
	CA string `json:"ca"`
	// Insecure: upstream's exporter then trusts whatever certificate the
	// endpoint presents. The project never writes it, and the node's
	// exporter refuses a configuration that sets it.
	Insecure bool `json:"insecure,omitempty"`
}

// ExporterConfigDriver is one driver of the tree: a driver class (Type,
// with its Config and Children), a composite of Children only, or a
// reference (Ref, a dot-separated path) to another driver of the tree.
type ExporterConfigDriver struct {
	// Type is the driver's fully qualified Python class name.
	Type string `json:"type,omitempty"`
	// Ref is the dot-separated path of the driver this entry stands for.
	Ref string `json:"ref,omitempty"`
	// Config is the driver's configuration object.
	Config *apiextv1.JSON `json:"config,omitempty"`
	// Children are the driver's child drivers, by name.
	Children map[string]ExporterConfigDriver `json:"children,omitempty"`
}

// ParseExporterConfig decodes an ExporterConfig document and checks what
// the exporter needs of it: the apiVersion and kind (when given, as
// upstream's reader defaults them), the Exporter's name, and driver entries
// that are each a class, a composite or a reference.
func ParseExporterConfig(data []byte) (*ExporterConfig, error) {
	var c ExporterConfig
	if err := yaml.Unmarshal(data, &c); err != nil {
		return nil, fmt.Errorf("decode ExporterConfig: %w", err)
	}
	var errs []error
	if c.APIVersion != "" && c.APIVersion != GroupVersion.String() {
		errs = append(errs, fmt.Errorf("apiVersion %q, want %s", c.APIVersion, GroupVersion))
	}
	if c.Kind != "" && c.Kind != ExporterConfigKind {
		errs = append(errs, fmt.Errorf("kind %q, want %s", c.Kind, ExporterConfigKind))
	}
	if c.Metadata.Name == "" {
		errs = append(errs, errors.New("metadata.name is empty"))
	}
	errs = append(errs, driverTreeErrors("export", c.Export)...)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("invalid ExporterConfig: %w", err)
	}
	return &c, nil
}

func driverTreeErrors(path string, drivers map[string]ExporterConfigDriver) []error {
	names := make([]string, 0, len(drivers))
	for n := range drivers {
		names = append(names, n)
	}
	sort.Strings(names)
	var errs []error
	for _, n := range names {
		d, at := drivers[n], path+"."+n
		switch {
		case n == "":
			errs = append(errs, fmt.Errorf("%s: a driver with an empty name", path))
		case d.Type != "" && d.Ref != "":
			errs = append(errs, fmt.Errorf("%s: type and ref are mutually exclusive", at))
		case d.Ref != "" && (d.Config != nil || len(d.Children) > 0):
			errs = append(errs, fmt.Errorf("%s: a ref entry has no config or children", at))
		case d.Type == "" && d.Config != nil:
			errs = append(errs, fmt.Errorf("%s: config without a driver type", at))
		}
		errs = append(errs, driverTreeErrors(at+".children", d.Children)...)
	}
	return errs
}
