package controller

import (
	"encoding/base64"
	"fmt"
	"strings"

	"sigs.k8s.io/yaml"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// The exporter Secret of an upstream set's pod holds, besides our keys
// (endpoint, token, namespace, name, ca.crt and the guest login), the key
// config.yaml: the ExporterConfig upstream's own reconciler writes into
// exporter-config-<exporter>, so that a tool reading upstream's layout
// finds it. The node's exporter reads config.yaml when the Secret has it
// (provider/exporter): the same settings, and exitOnLeaseEnd.

// upstreamExporterConfig is the ExporterConfig document of Exporter
// (namespace, name) of an upstream set, as upstream's reconciler writes
// it: the endpoint, the CA bundle base64 encoded (empty: none), the token,
// the template's drivers by name, and exitOnLeaseEnd unless the set
// reuses its instances (InPlaceReuse). Pure.
func upstreamExporterConfig(set *vtv1.ExporterSet, reuse bool, ca, namespace, name, endpoint string, token []byte) ([]byte, error) {
	export := make(map[string]jsv1.ExporterConfigDriver, len(set.Spec.Template.Spec.Drivers))
	for _, d := range set.Spec.Template.Spec.Drivers {
		if _, dup := export[d.Name]; dup {
			return nil, fmt.Errorf("spec.template.spec.drivers: driver name %q appears twice", d.Name)
		}
		if d.Ref != "" {
			export[d.Name] = jsv1.ExporterConfigDriver{Ref: d.Ref}
			continue
		}
		export[d.Name] = jsv1.ExporterConfigDriver{Type: d.Type, Config: d.Config.DeepCopy()}
	}
	if len(export) == 0 {
		export = nil
	}
	c := jsv1.ExporterConfig{
		APIVersion:     jsv1.GroupVersion.String(),
		Kind:           jsv1.ExporterConfigKind,
		Metadata:       jsv1.ExporterConfigMetadata{Name: name, Namespace: namespace},
		Endpoint:       endpoint,
		TLS:            &jsv1.ExporterConfigTLS{CA: base64.StdEncoding.EncodeToString([]byte(ca))},
		Token:          strings.TrimSpace(string(token)),
		Export:         export,
		ExitOnLeaseEnd: !reuse,
	}
	b, err := yaml.Marshal(c)
	if err != nil {
		return nil, fmt.Errorf("marshal the ExporterConfig of %s/%s: %w", namespace, name, err)
	}
	return b, nil
}
